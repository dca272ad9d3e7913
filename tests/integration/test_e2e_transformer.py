"""End-to-end check: a transformer block trained with graphs equals eager.

Attention + MLP + LayerNorm + dropout, the MLP under Fleet's recompute, 20 AdamW steps with
gradient accumulation 2: every loss and every final parameter bit for bit. The model and loop
live in paddlefleet.cudagraph.demo.transformer_blocks, which the demo runs too.
"""

import numpy as np
from parameterized import parameterized

from paddlefleet.cudagraph.demo import transformer_blocks as examples

from testkit.harness import BackendCase, for_each_backend

STEPS, ACCUMULATE = 20, 2


@for_each_backend
class TransformerEndToEndTest(BackendCase):
    @parameterized.expand([("clone_param_grads", True), ("no_clone_param_grads", False), ("auto", "auto"),
                           ("accumulate_in_graph", "in_graph")])
    def test_twenty_adamw_steps_bitwise_equal_eager(self, _, clone):
        options = {"accumulate_in_graph": True} if clone == "in_graph" else {"clone_param_grads": clone}
        result = examples.compare_transformer(steps=STEPS, accumulate=ACCUMULATE, backend=self.backend, **options)
        self.assertBitwise(result.graphed.losses, result.eager.losses, "losses")
        self.assertBitwise(result.graphed.params, result.eager.params, "final parameters")
        self.assertTrue(result.equal, result.first_mismatch)
        stats = result.graphed.stats
        micro_batches = STEPS * ACCUMULATE
        self.assertEqual(
            (stats["warmup_calls"], stats["captures"], stats["replays"], stats["eager_calls"], stats["recaptures"]),
            (1, 1, micro_batches - 2, 0, 0),
        )
        # It trained: parameters moved and the loss went down.
        self.assertLess(float(np.mean(result.eager.losses[-4:])), float(np.mean(result.eager.losses[:4])))

    def test_block_has_every_part(self):
        block = examples.transformer_block()
        names = {name for name, _ in block.named_sublayers()}
        self.assertTrue({"ln1", "ln2", "attn", "mlp", "attn.attn_drop", "mlp.drop"} <= names, names)
        self.assertTrue(block.recompute_mlp)
        self.assertGreater(block.mlp.drop.p, 0.0)
