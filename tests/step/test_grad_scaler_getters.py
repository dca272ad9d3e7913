"""GraphGradScaler's getters (those of paddle.amp.GradScaler) each return their own setting."""

import unittest

from paddlefleet.cudagraph.step.grad_scaler import GraphGradScaler

SETTINGS = dict(init_loss_scaling=1024.0, incr_ratio=3.0, decr_ratio=0.25, incr_every_n_steps=7,
                decr_every_n_nan_or_inf=5, use_dynamic_loss_scaling=False)
GETTERS = {"is_enable": True, "is_use_dynamic_loss_scaling": False, "get_init_loss_scaling": 1024.0,
           "get_incr_ratio": 3.0, "get_decr_ratio": 0.25, "get_incr_every_n_steps": 7, "get_decr_every_n_nan_or_inf": 5}


class GetterTest(unittest.TestCase):
    def test_each_getter_returns_its_own_setting(self):
        scaler = GraphGradScaler(**SETTINGS)
        for name, expected in GETTERS.items():
            with self.subTest(name=name):
                self.assertEqual(getattr(scaler, name)(), expected)
                self.assertIs(type(getattr(scaler, name)()), type(expected))


if __name__ == "__main__":
    unittest.main()
