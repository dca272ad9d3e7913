"""The entries of a wrapper stay in least-recently-used order (report() and explain() list keys in
it) although a call of the latest key no longer moves it: it is already last."""

import collections
import unittest

import paddle

from paddlefleet.cudagraph import autocudagraph


class EntryOrderTest(unittest.TestCase):
    def test_report_lists_keys_least_recently_used_first(self):
        graphed = autocudagraph(lambda x: x * 2.0, backend="simulate", warmup_steps=1)
        shapes = {name: paddle.ones([n, 2]) for name, n in (("a", 1), ("b", 2), ("c", 3))}
        expected = collections.OrderedDict()
        for name in ["a", "a", "b", "a", "a", "c", "b", "b", "a", "c", "c"]:
            graphed(shapes[name])
            expected[name] = True
            expected.move_to_end(name)
            rows = graphed.report()
            self.assertEqual([row["label"] for row in rows], [f"(x: float32[{shapes[n].shape[0]}, 2])" for n in expected])
        graphed.reset()
        graphed(shapes["c"])
        graphed(shapes["a"])
        graphed(shapes["c"])
        self.assertEqual(len(graphed.report()), 2)
        self.assertEqual([row["label"] for row in graphed.report()], ["(x: float32[1, 2])", "(x: float32[3, 2])"])


if __name__ == "__main__":
    unittest.main()
