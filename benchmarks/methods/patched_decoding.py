"""Greedy decoding of a patched Hugging Face model: generate() over its key/value cache against use_cache=False.

A tiny random-weight Llama (grouped-query heads) is built from a config (no download) and patched as
tests/test_hf_generate.py patches it where a cache gives uncached scoring's tokens: exact attention and LSH with a
fixed n_buckets in every layer, HyperAttention and LSH with the default n_buckets in the last layer
(docs/patching.md, "Cached decoding"). For each patch and context length, `generate()` decodes `--new` tokens
greedily from a random prompt of that length, once with the cache (a step runs the newest position; the patched
layer recomputes its last row, models/hf_patching.py) and once with use_cache=False (every step scores the whole
prefix). The two alternate (harness.interleaved_medians), so load from other jobs on a shared machine hits both
alike; each row says whether the two gave the same tokens. Times include the prompt's pass.

    python -m benchmarks.methods.patched_decoding --out benchmarks/results               # contexts 1024 and 4096
    python -m benchmarks.methods.patched_decoding --out /tmp/bench --contexts 64 --new 4 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.harness import Row, add_ratios, interleaved_medians, results_dir, write_csv
from models.dropin import PatchConfig
from models.hf_patching import patch_hf_model

PATCHES = {
    "unpatched": None,
    "exact": PatchConfig(layers="all", attention={"kind": "exact"}),
    "lsh-fixed-buckets": PatchConfig(layers="all", attention={"kind": "lsh", "bucket_size": 64, "n_hashes": 2,
                                                              "n_buckets": 64}),
    "lsh-last": PatchConfig(layers="last:1", attention={"kind": "lsh", "bucket_size": 64, "n_hashes": 2}),
    "hyper-last": PatchConfig(layers="last:1", attention={"kind": "hyper", "block_size": 64, "sample_size": 64,
                                                          "min_seq_len": 256, "lsh_bits": 7}),
}
"""Row name -> the patch (None: the model's own SDPA attention)."""

PATHS = {"uncached": False, "cached": True}
"""Row path -> generate()'s use_cache."""


def tiny_llama(max_len: int, hidden: int, layers: int) -> torch.nn.Module:
    """A random-weight Llama with 4 query heads over 2 key/value heads, long enough for `max_len` positions."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def run(contexts: list[int], *, new: int, repeats: int, hidden: int, layers: int) -> list[Row]:
    rows: list[Row] = []
    for name, patch in PATCHES.items():
        model = tiny_llama(max(contexts) + new, hidden, layers)
        if patch is not None:
            patch_hf_model(model, patch)
        for context in contexts:
            prompt = torch.randint(1, 100, (1, context), generator=torch.Generator().manual_seed(context))
            tokens: dict[str, torch.Tensor] = {}

            def decode(path: str):
                def call() -> None:
                    with torch.no_grad():
                        tokens[path] = model.generate(prompt, max_new_tokens=new, min_new_tokens=new,
                                                      do_sample=False, pad_token_id=0, eos_token_id=None,
                                                      use_cache=PATHS[path])[0, context:]
                return call

            times = interleaved_medians({path: decode(path) for path in PATHS}, torch.device("cpu"), warmup=0,
                                        repeats=repeats)
            same = bool(torch.equal(tokens["cached"], tokens["uncached"]))
            for path, seconds in times.items():
                rows.append({
                    "patch": name, "layers": "none" if patch is None else patch.layers, "context": context,
                    "new_tokens": new, "path": path, "hidden": hidden, "model_layers": layers,
                    "threads": torch.get_num_threads(), "median_s": statistics.median(seconds), "min_s": min(seconds),
                    "repeats": len(seconds), "tokens_per_s": new / statistics.median(seconds),
                    "same_tokens": same, "case": f"{name}@{context}",
                })
    add_ratios(rows, key="case", baseline=lambda row: row["path"] == "uncached",
               columns={"median_s": "speedup_vs_uncached"})
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="results folder (a machine subfolder is added)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096], help="prompt lengths")
    parser.add_argument("--new", type=int, default=16, help="tokens generated per call")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds per path")
    parser.add_argument("--hidden", type=int, default=64, help="the model's hidden size")
    parser.add_argument("--layers", type=int, default=2, help="the model's layers")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--name", default="patched_decoding", help="CSV file name (without .csv)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.contexts, new=args.new, repeats=args.repeats, hidden=args.hidden, layers=args.layers)
    path = write_csv(rows, results_dir(args.out, torch.device("cpu")) / f"{args.name}.csv")
    for row in rows:
        print(f"{row['patch']:>18} n={row['context']:>5} {row['path']:>8}: {row['tokens_per_s']:8.2f} tokens/s "
              f"(median {row['median_s']:.2f} s), x{row['speedup_vs_uncached']:.2f} vs uncached, "
              f"same tokens: {row['same_tokens']}")
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
