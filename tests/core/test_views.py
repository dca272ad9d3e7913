"""core/views.py: ``entries()``, ``entry(key)`` and ``body()`` hand out read-only views of a wrapper's insides."""

import unittest

import paddle

from paddlefleet.cudagraph import autocudagraph, autocudagraph_step


class ViewsTest(unittest.TestCase):
    def test_entries_and_body_read_but_do_not_rebind(self):
        f = autocudagraph(lambda x: x * 2, backend="simulate", warmup_steps=0)
        with self.assertRaisesRegex(LookupError, "no key yet"):
            f.entry()
        f(paddle.ones([2]))
        f(paddle.ones([2]))
        entries = f.entries()
        self.assertEqual(len(entries), 1)
        [(key, entry)] = entries.items()
        self.assertEqual(f.entry(), entry)
        self.assertEqual(f.entry(key), entry)
        self.assertEqual(entry.replays, 1)
        self.assertIsNotNone(entry.graphs)
        with self.assertRaisesRegex(AttributeError, "read-only view of GraphEntry: 'graphs' cannot be set"):
            entry.graphs = None
        with self.assertRaisesRegex(AttributeError, "read-only view"):
            del entry.graphs
        with self.assertRaises(TypeError):
            entries[key] = None  # the mapping is read-only too
        self.assertIsNotNone(f.entry().graphs, "the wrapper's entry kept its graphs")
        body = f.body()
        self.assertEqual(body.api, "autocudagraph")
        with self.assertRaisesRegex(AttributeError, "read-only view of BlockBody"):
            body.options = None
        f(paddle.ones([3]))
        with self.assertRaisesRegex(LookupError, "2 keys; pass one of them as key="):
            f.entry()

    def test_a_step_hands_out_views_too(self):
        step = autocudagraph_step(lambda x: x + 1, optimizers=[], backend="simulate")
        for _ in range(4):
            step(paddle.ones([2]))
        self.assertEqual((step.entry().warmup_calls, step.entry().replays), (2, 1))  # 2 warmups, the capture, 1 replay
        self.assertEqual(step.body().api, "autocudagraph_step")


if __name__ == "__main__":
    unittest.main()
