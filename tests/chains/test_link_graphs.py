"""Link graphs (NOTE [ Link graphs ] in chains/link_graphs.py): the grad a chain member gets from the next one,
copied from that member's static input grad into its grad-output buffer by a captured graph of that one copy
where it provably copies what the launched copy would, and launched otherwise.

Every chain case trains a graphed twin and an eager twin on the same batches and compares them bit for bit after
every step (testkit.differential). Matmul-only (gpu_safe): tools/gpu_check.py runs them on a GPU.
"""

from unittest import mock

import numpy as np
import paddle

from paddlefleet.cudagraph.backends import resolve_backend
from paddlefleet.cudagraph.chains import link_graphs
from paddlefleet.cudagraph.chains.link_graphs import LinkGraphs
from testkit.common import eager_calls, normal
from testkit.harness import MatmulOnlyCase, for_each_backend

from .test_chains import LAYERS, WIDTH, ChainCase, chained, forward_backward


def links(layer):
    """The LinkGraphs that write ``layer``'s key's buffers, or None."""
    [entry] = layer.forward.entries().values()
    return entry.graphs.current.links


def replays(layer):
    found = links(layer)
    return 0 if found is None else found.replays


@for_each_backend
class LinkGraphChainCases(ChainCase, MatmulOnlyCase):
    """Chains whose members' copies go through link graphs, or are launched where a link cannot be proven."""

    def tensor(self, array, grad=False):
        return MatmulOnlyCase.tensor(self, array, grad)

    def test_each_member_gets_its_grad_through_a_link_graph_bitwise(self):
        model = self.run_twins(forward_backward, self.batches())
        runs = chained(model)[LAYERS - 1]
        self.assertEqual(runs, 4)
        # Members before the last get the next member's static input grad; the last gets the caller's dy.
        self.assertEqual([replays(layer) for layer in model], [runs] * (LAYERS - 1) + [0])
        for layer in model:
            self.assertEqual(eager_calls(layer.forward.stats()), 0, layer.forward.explain())
        self.assertIn(f"{runs} output grad(s) from the next chained call copied in by a link graph",
                      model[0].forward.explain())
        self.assertNotIn("link graph", model[LAYERS - 1].forward.explain())

    def test_outputs_handed_as_static_buffers_still_link_only_the_grads(self):
        model = self.run_twins(forward_backward, self.batches(), clone_outputs=False)
        runs = chained(model)[LAYERS - 1]
        self.assertEqual(runs, 4)
        self.assertEqual([replays(layer) for layer in model], [runs] * (LAYERS - 1) + [0])

    def test_a_handed_out_output_written_without_a_version_count_is_read_by_the_next_call(self):
        draw = normal(7)
        new = [draw(8, WIDTH)[:4] for _ in range(self.steps)]

        for clone in (True, False):
            with self.subTest(clone_outputs=clone):
                def step(model, test, x, dy, k):
                    h = model[1](model[0](x))
                    with paddle.no_grad():
                        if k % 2:
                            h.copy_(test.tensor(new[k]), False)  # no inplace version count either way
                        else:
                            h.set_value(new[k])
                    h = model[3](model[2](h))
                    h.backward(dy)
                    return test.results(model, x, h)

                model = self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches())], clone_outputs=clone)
                self.assertEqual(chained(model)[3], 4)

    def test_a_hook_on_an_output_takes_the_launched_grad_copy(self):
        def step(model, test, x, dy):
            kept = []
            h1 = model[1](model[0](x))
            h1.register_hook(lambda g: kept.append(g))  # its member's grad goes through the hook: a copy
            h = model[3](model[2](h1))
            h.backward(dy)
            return test.results(model, x, h, [g.numpy() for g in kept])

        model = self.run_twins(step, self.batches())
        self.assertEqual(chained(model)[3], 4)
        self.assertEqual([replays(layer) for layer in model], [4, 0, 4, 0])

    def test_a_link_whose_capture_fails_leaves_the_launched_copy_for_good(self):
        with mock.patch.object(link_graphs, "copy_body", side_effect=RuntimeError("no capture here")) as body:
            model = self.run_twins(forward_backward, self.batches())
        self.assertEqual(chained(model)[3], 4)
        self.assertEqual([replays(layer) for layer in model], [0] * LAYERS)
        # one attempt per pair of buffers (every member before the last, one per grad set of the next member)
        pairs = sum(len(links(layer).by_src) for layer in model if links(layer) is not None)
        self.assertEqual(body.call_count, pairs)
        self.assertGreaterEqual(pairs, LAYERS - 1)

    def test_released_graphs_free_their_links(self):
        model = self.run_twins(forward_backward, self.batches())
        held = links(model[0])
        graphs = [link.graph for link in held.by_src.values()]
        self.assertTrue(graphs)
        with mock.patch.object(type(graphs[0]), "reset", autospec=True) as reset:
            model[0].forward.reset()
        self.assertEqual({call.args[0] for call in reset.call_args_list} >= set(graphs), True)
        self.assertEqual(held.by_src, {})


@for_each_backend
class LinkGraphUnitCases(MatmulOnlyCase):
    """LinkGraphs alone, on two buffers."""

    def setUp(self):
        super().setUp()
        backend, _ = resolve_backend(self.backend, [self.tensor(np.zeros([1], "float32"))])
        self.links = LinkGraphs(backend)
        self.addCleanup(self.links.release)

    def buffers(self, *shape):
        draw = normal(11)
        return [self.tensor(draw(*shape)) for _ in range(2)]

    def test_a_link_copies_what_the_source_holds_when_it_replays(self):
        src, dst = self.buffers(4, 8)
        self.assertTrue(self.links.copy(dst, src))
        self.assertBitwise(dst.numpy(), src.numpy())
        with paddle.no_grad():
            src.copy_(self.tensor(np.full([4, 8], 3.5, "float32")), False)
        self.assertTrue(self.links.copy(dst, src))
        self.assertBitwise(dst.numpy(), np.full([4, 8], 3.5, "float32"))
        self.assertEqual((self.links.count(), self.links.replays), (1, 2))

    def test_a_copy_that_casts_or_reshapes_is_never_captured(self):
        src, _ = self.buffers(4, 8)
        wide = paddle.to_tensor(np.zeros([4, 8], "float64"), place=src.place)
        for dst in (self.buffers(8, 4)[0], wide):
            before = dst.numpy().copy()
            self.assertFalse(self.links.copy(dst, src))
            self.assertBitwise(dst.numpy(), before)
        self.assertEqual(self.links.count(), 0)

    def test_a_source_given_back_is_forgotten(self):
        src, dst = self.buffers(4, 8)
        self.assertTrue(self.links.copy(dst, src))
        del src
        other, _ = self.buffers(4, 8)
        self.assertTrue(self.links.copy(dst, other))
        self.assertEqual(len(self.links.by_src), 1)
        self.assertBitwise(dst.numpy(), other.numpy())
