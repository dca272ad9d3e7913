"""Outputs handed back as they are (NOTE [ Outputs handed back as they are ] in io/output_aliases.py): a graphed
block or whole step that returns its own argument hands back the caller's tensor, one that returns a parameter
of its Layers hands back that parameter (a reference the caller keeps follows its updates), and one that returns
a tensor at several places of its result hands back one object there, as eager does, on every replay; values and
grads bitwise against eager. The matmul-only cases also run on a GPU (tools/gpu_check.py). On the simulated backend a
replay whose result holds its inputs otherwise than the capture's runs eagerly from then on."""

import unittest
import warnings

import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step
from testkit.common import MatMLP
from testkit.harness import MatmulOnlyCase, for_each_backend, normal
from testkit.step_gpu import MatmulSGD


def _flat(result):
    """The tensors of a result of the shape these cases return, in order."""
    return [result["y"], *result["more"]] if isinstance(result, dict) else list(result)


@for_each_backend
class OutputAliasCases(MatmulOnlyCase):
    def run_block(self, body, calls=4):
        """``body(model, x)`` graphed and eager on twin MatMLPs; per call: the results bitwise, each result tensor
        the call's input exactly where eager's is, one object exactly where eager's is; y.backward(dy) and the
        parameters' grads bitwise (then released). Returns the graphed wrapper and its model."""
        draw = normal(41)
        model, twin = MatMLP([8, 8, 8]), MatMLP([8, 8, 8])
        twin.set_state_dict(model.state_dict())
        graphed = autocudagraph(lambda x: body(model, x), warmup_steps=1, backend=self.backend)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing refused, nothing warned
            for k in range(calls):
                xn, dyn = draw(4, 8), draw(4, 8)
                xg, xe = self.tensor(xn), self.tensor(xn)
                got, want = _flat(graphed(xg)), _flat(body(twin, xe))
                self.assertBitwise(got, want, f"call {k}")
                self.assertEqual([t is xg for t in got], [t is xe for t in want], f"call {k}: the input handed back")
                self.assertEqual([[a is b for b in got] for a in got], [[a is b for b in want] for a in want],
                                 f"call {k}: one object at several places")
                got[0].backward(self.tensor(dyn))
                want[0].backward(self.tensor(dyn))
                self.assertBitwise([p.grad for p in model.parameters()], [p.grad for p in twin.parameters()],
                                   f"call {k} grads")
                for p in model.parameters() + twin.parameters():
                    p.clear_gradient(False)
        return graphed, model

    def test_a_block_returning_its_input_hands_back_the_callers_tensor(self):
        graphed, _ = self.run_block(lambda m, x: (m(x), x))
        self.assertCounters(graphed, captures=1, replays=2, eager=0)

    def test_a_tensor_returned_at_several_places_is_one_object(self):
        def body(m, x):
            y = m(x)
            return {"y": y, "more": [y, x, x, y]}

        graphed, _ = self.run_block(body)
        self.assertCounters(graphed, captures=1, replays=2, eager=0)

    def test_a_block_returning_a_parameter_hands_back_the_parameter(self):
        """f(x) = (m(x), m's first weight): the parameter itself on every call, as eagerly."""
        graphed, model = self.run_block(lambda m, x: (m(x), m.parameters()[0]))
        self.assertCounters(graphed, captures=1, replays=2, eager=0)
        self.assertIs(graphed(self.tensor(normal(44)(4, 8)))[1], model.parameters()[0])

    def test_a_whole_step_returning_the_parameter_it_updates(self):
        """A step updating its parameter (MatmulSGD) and returning it: the caller keeps each step's result, and
        after the last step every kept one equals eager's kept one (eagerly they are the parameter, updated)."""
        self.check_kept_parameter(lambda w: w, same=True)

    def test_a_whole_step_returning_a_detach_of_the_parameter_it_updates(self):
        """The same with ``w.detach()`` returned: eagerly a new tensor per step sharing the parameter's storage, so
        every kept one follows the updates too; a replay hands out a new detach() of the parameter per call."""
        self.check_kept_parameter(lambda w: w.detach(), same=False)

    def check_kept_parameter(self, returned, same):
        """A MatmulSGD step returning ``(y, returned(its parameter))``, graphed and eager; after the last step every
        kept second result bitwise eager's; it is the parameter itself exactly when ``same``."""
        draw = normal(43)
        model, twin = MatMLP([8, 8]), MatMLP([8, 8])
        twin.set_state_dict(model.state_dict())

        def make(m):
            opt = MatmulSGD(m.parameters(), 0.1)

            def step(x, dy):
                y = m(x)
                y.backward(dy)
                opt.step()
                opt.clear_grad()
                return y, returned(m.parameters()[0])

            return step

        graphed, eager = autocudagraph_step(make(model), optimizers=[], warmup_steps=1, backend=self.backend), \
            make(twin)
        kept_g, kept_e = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for k in range(5):
                xn, dyn = draw(4, 8), draw(4, 8)
                yg, wg = graphed(self.tensor(xn), self.tensor(dyn))
                ye, we = eager(self.tensor(xn), self.tensor(dyn))
                self.assertBitwise(yg, ye, f"step {k}")
                self.assertEqual(wg is model.parameters()[0], same)
                self.assertEqual(wg.data_ptr(), model.parameters()[0].data_ptr())
                kept_g.append(wg)
                kept_e.append(we)
        self.assertBitwise(kept_g, kept_e, "the kept results after the last step")
        self.assertCounters(graphed, captures=1, replays=3, eager=0)

    def test_a_whole_step_returning_its_input_and_an_output_twice(self):
        """A whole step returning (y, x, y, dy): the caller's x and dy back, y one object; every step bitwise."""
        draw = normal(42)
        model, twin = MatMLP([8, 8, 8]), MatMLP([8, 8, 8])
        twin.set_state_dict(model.state_dict())

        def make(m):
            def step(x, dy):
                y = m(x)
                y.backward(dy)
                for p in m.parameters():
                    p.clear_gradient(False)
                return y, x, y, dy

            return step

        graphed, eager = autocudagraph_step(make(model), optimizers=[], warmup_steps=1, backend=self.backend), \
            make(twin)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for k in range(5):
                xn, dyn = draw(4, 8), draw(4, 8)
                args_g, args_e = (self.tensor(xn), self.tensor(dyn)), (self.tensor(xn), self.tensor(dyn))
                got, want = list(graphed(*args_g)), list(eager(*args_e))
                self.assertBitwise(got, want, f"step {k}")
                self.assertEqual([[a is b for b in got + list(args_g)] for a in got],
                                 [[a is b for b in want + list(args_e)] for a in want], f"step {k}: identities")
        self.assertCounters(graphed, captures=1, replays=3, eager=0)


class SimulatedAliasReplayTest(unittest.TestCase):
    def check_other_tensor_at_replay(self, wrap):
        """Captured returning its input; a later call returns a closure tensor there instead (no op differs). A GPU
        would hand back the input again; the simulated replay sees the result differ and the key runs eagerly,
        with eager's result from that call on. ``wrap(fn)``: the graphed wrapper of ``fn``."""
        other = paddle.ones([4, 8])
        flag = [True]
        model = MatMLP([8, 8])
        graphed = wrap(lambda x: (model(x), x if flag[0] else other))
        x = paddle.randn([4, 8])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                self.assertIs(graphed(x)[1], x)
            flag[0] = False
            for _ in range(2):
                self.assertIs(graphed(x)[1], other)
        self.assertEqual(graphed.stats()["captures"], 1)
        messages = " ".join(str(w.message) for w in caught)
        self.assertIn("returned its inputs, its Layers' tensors or repeated outputs otherwise than the capture",
                      messages)
        self.assertIn("result tensor 1 is input 0", messages)

    def test_a_replay_returning_another_tensor_than_its_input_runs_eagerly(self):
        self.check_other_tensor_at_replay(lambda fn: autocudagraph(fn, warmup_steps=1, backend="simulate"))

    def test_a_step_replay_returning_another_tensor_than_its_input_runs_eagerly(self):
        self.check_other_tensor_at_replay(
            lambda fn: autocudagraph_step(fn, optimizers=[], warmup_steps=1, backend="simulate"))


if __name__ == "__main__":
    unittest.main()
