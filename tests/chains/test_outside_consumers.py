"""Intermediate outputs of a chain with consumers outside it (NOTE [ Outputs with consumers outside the
chain ] in chains/links.py): eager adds each consumer's grad in the order its backward engine runs them,
which a chain cannot prove, so no chain goes through such an output: the calls replay alone, bitwise,
and explain() says why.

Matmul-only (gpu_safe): tools/gpu_check.py runs these on a GPU, bitwise against eager. The grads of an
output used several times are added by Paddle's backward engine, eagerly and graphed alike, so these cases
need Paddle's add kernel and skip on a GPU whose Paddle lacks it (Hopper with Paddle 2.6.2).
"""

from testkit.common import cuda_skip_reason, normal
from testkit.harness import MatmulOnlyCase, for_each_backend

from .test_chains import BATCH, WIDTH, ChainCase, chained

import paddle

STEPS = 10


def matmuls(h, weights):
    for w in weights:
        h = paddle.matmul(h, w)
    return h


@for_each_backend
class OutsideConsumerCases(ChainCase, MatmulOnlyCase):
    """Deep supervision: a Layer's output used by the next Layer and by auxiliary terms."""

    def setUp(self):
        super().setUp()
        reason = cuda_skip_reason("all") if self.backend == "cuda" else None
        if reason:
            self.skipTest(f"adding an output's grads from several consumers needs Paddle's add kernel: {reason}")

    def tensor(self, array, grad=False):
        return MatmulOnlyCase.tensor(self, array, grad)

    def weights(self, n, seed):
        draw = normal(seed)
        return [self.tensor(draw(WIDTH, WIDTH, scale=0.3)) for _ in range(n)]

    def supervised(self, aux, first_step=0):
        """Each step: four Layers; from ``first_step`` on, ``aux(h1)`` terms get grads too."""
        draw = normal(21)
        dys = [self.tensor(draw(BATCH, WIDTH)) for _ in range(3)]

        def step(model, test, x, dy, k):
            h1 = model[1](model[0](x))
            h = model[3](model[2](h1))
            terms = aux(h1) if k >= first_step else []
            paddle.autograd.backward([h] + terms, [dy] + dys[:len(terms)])
            return test.results(model, x, h, [t.numpy() for t in terms])

        return self.run_twins(step, [b + (k,) for k, b in enumerate(self.batches(STEPS))])

    def test_deep_supervision_two_auxiliary_terms_one_through_several_ops(self):
        head, deep = self.weights(1, 22), self.weights(4, 23)
        model = self.supervised(lambda h1: [matmuls(h1, head), matmuls(h1, deep)])
        # Layers 0-1 and 2-3 chain from step 4 on; the link from Layer 1 to Layer 2 is barred while the
        # calls replay alone (the auxiliary terms' grads reach Layer 1's output before Layer 2's).
        self.assertEqual(chained(model), [0, STEPS - 4, 0, STEPS - 4])
        self.assertIn("consumers outside the chain", model[1].forward.explain())
        self.assertNotIn("consumers outside the chain", model[0].forward.explain())

    def test_an_outside_consumer_that_appears_after_the_chain_formed(self):
        """One outside consumer, first seen by a chain's backward: that backward adds two terms (exact),
        and the link is barred from then on."""
        head = self.weights(1, 24)
        model = self.supervised(lambda h1: [matmuls(h1, head)], first_step=6)
        # Steps 4 and 5 chain all four Layers, step 6's backward bars the link into Layer 2; Layer 2 heads
        # a chain into Layer 3 from step 7 on.
        self.assertEqual(chained(model), [0, STEPS - 4, 3, STEPS - 4])
        self.assertIn("consumers outside the chain", model[1].forward.explain())

    def test_an_intermediate_output_given_its_own_grad_as_a_root(self):
        """``paddle.autograd.backward([h, h1], ...)``: an auxiliary loss's grad handed to Layer 1's output
        itself. Some Paddles (2.6) crash when a root is consumed directly by another root's grad node; the
        chain headed by Layer 2 would be that node, so there it takes its first argument through views
        (NOTE [ Chains of graphed calls ] in chains/chain.py) and the backward runs, bitwise eager's."""
        model = self.supervised(lambda h1: [h1], first_step=6)
        # Steps 4-6 chain all four Layers; step 6's backward bars the link into Layer 2, which heads a chain
        # into Layer 3 from step 7 on.
        self.assertEqual(chained(model), [0, STEPS - 4, 3, STEPS - 4])
