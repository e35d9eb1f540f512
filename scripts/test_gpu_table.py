#!/usr/bin/env python3
"""Tests of scripts/gpu_table.py on made-up bench outputs (standard library only)."""
import json, os, subprocess, sys, tempfile, unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def model(tg, pp, slots=None):
    doc = {"tg": {"test": "tg128", "tok_per_s": tg}, "pp": [{"test": t, "tok_per_s": v} for t, v in pp.items()]}
    if slots:
        doc["slots"] = {"sequences": 4, "aggregate_tok_per_s": slots}
    return doc


def llama(rates, size=15.0e9, params=27.0e9):
    return [{"n_prompt": 0 if t.startswith("tg") else int(t[2:]), "n_gen": int(t[2:]) if t.startswith("tg") else 0,
             "avg_ts": v, "model_size": size, "model_n_params": params} for t, v in rates.items()]


class GpuTable(unittest.TestCase):
    def run_table(self, files):
        with tempfile.TemporaryDirectory() as d:
            for name, doc in files.items():
                with open(os.path.join(d, name), "w") as f:
                    json.dump(doc, f)
            out = subprocess.run([sys.executable, os.path.join(HERE, "gpu_table.py"), d, "--json",
                                  os.path.join(d, "t.json")], capture_output=True, text=True, check=True)
            with open(os.path.join(d, "t.json")) as f:
                return json.load(f), out.stdout

    def test_ratios_floors_and_bars(self):
        rep, text = self.run_table({
            "gpu-model-30b.json": model(200.0, {"pp2048": 9000.0}, slots=400.0),
            "llama-bench.json": llama({"tg128": 100.0, "pp2048": 3000.0}),
            "gpu-model-30b-d8192.json": model(180.0, {"pp2048": 5000.0}),
            "llama-bench-d8192.json": llama({"tg128": 90.0, "pp2048": 2900.0}),
        })
        d0 = {r["test"]: r for r in rep["tables"]["Q4_K, depth 0"]}
        self.assertAlmostEqual(d0["tg128"]["ratio"], 2.0)
        self.assertAlmostEqual(d0["pp2048"]["ratio"], 3.0)
        # 4.3e12 B/s over 15e9 B per token; 790e12 FLOP/s over 2 * 27e9 FLOP per token.
        self.assertAlmostEqual(d0["tg128"]["share_of_floor"], 200.0 / (4.3e12 / 15.0e9))
        self.assertAlmostEqual(d0["pp2048"]["share_of_floor"], 9000.0 / (790e12 / 54e9))
        self.assertIsNone(d0["4 sequences, tg aggregate"]["llama_cpp"])
        self.assertAlmostEqual(d0["4 sequences, tg aggregate"]["share_of_floor"], 400.0 / (4 * 4.3e12 / 15.0e9))
        bars = rep["bars"]
        self.assertTrue(bars["tg128 Q4_K, depth 0"]["met"])
        self.assertFalse(bars["tg128 Q4_K, depth 8192"]["met"])
        self.assertFalse(bars["pp2048 Q4_K, depth 8192"]["met"])
        self.assertIn("NOT met (180.0)", text)

    def test_missing_and_broken_files_are_skipped(self):
        rep, text = self.run_table({"gpu-model-30b.json": model(190.0, {}), "llama-bench.json": ["no rows", {}],
                                    "llama-bench-d8192.json": "not a list"})
        self.assertEqual(list(rep["tables"]), ["Q4_K, depth 0"])
        row = rep["tables"]["Q4_K, depth 0"][0]
        self.assertIsNone(row["ratio"])
        self.assertIsNone(row["share_of_floor"])
        self.assertNotIn("NVFP4", text)


if __name__ == "__main__":
    unittest.main()
