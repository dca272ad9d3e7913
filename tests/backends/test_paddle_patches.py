"""guards/paddle_patches.py: every patch is put back exactly, in order, whatever happens."""

import unittest

import paddle

from paddlefleet.cudagraph.guards.paddle_patches import Patches, patched


class _Base:
    def method(self):
        return "base"


class _Owner(_Base):
    own = "own"


class PatchesTest(unittest.TestCase):
    def test_an_exception_inside_restores_every_patch(self):
        with self.assertRaises(KeyError):
            with patched((_Owner, "own", "patched"), (_Owner, "method", lambda self: "patched")):
                self.assertEqual((_Owner.own, _Owner().method()), ("patched", "patched"))
                raise KeyError("inside")
        self.assertEqual((_Owner.own, _Owner().method()), ("own", "base"))

    def test_an_inherited_attribute_is_inherited_again(self):
        with patched((_Owner, "method", lambda self: "patched")):
            self.assertIn("method", _Owner.__dict__)
        self.assertNotIn("method", _Owner.__dict__)  # not frozen as the owner's own copy
        self.assertEqual(_Owner().method(), "base")

    def test_nested_patches_of_one_attribute_unwind_in_order(self):
        outer, inner = Patches(), Patches()
        outer.set(_Owner, "own", "outer")
        inner.set(_Owner, "own", "inner")
        self.assertEqual(_Owner.own, "inner")
        inner.restore()
        self.assertEqual(_Owner.own, "outer")
        outer.restore()
        self.assertEqual(_Owner.own, "own")

    def test_a_paddle_method_is_restored(self):
        original = paddle.Tensor.__dict__.get("clear_gradient")
        with patched((paddle.Tensor, "clear_gradient", lambda self, set_to_zero=True: "patched")):
            self.assertEqual(paddle.zeros([1]).clear_gradient(), "patched")
        self.assertIs(paddle.Tensor.__dict__.get("clear_gradient"), original)


if __name__ == "__main__":
    unittest.main()
