"""Preparing and reading corpora of 20 MB, 200 MB and 1 GB: time, tokens/s, memory, and the reader's speed.

Each corpus is WikiText-2 (valid.txt then test.txt of ../shared/data/wikitext-2, the two splits shipped there)
repeated to the size, as a causal-LM spec's task.files.train (vocab 8000, the smoke spec's seq_len 64 and
batch_size 16). Every measurement runs in its own process, sampled every 0.2 s with psutil over the process and
its children:
- `prepare`: `orchestrator prepare SPEC task.prepare_workers=2` from nothing (tokenizer sample and training,
  fingerprint, both splits): wall time, peak RSS summed over the processes (shared pages counted in each: an
  upper bound), peak PSS summed (shared pages split: the memory actually used), the main process's peak RSS.
- `tokenise_1` / `tokenise_2`: the prepared splits removed and prepared again with 1 or 2 processes (the
  tokenizer cached): the tokenising pipeline alone, whose ratio is the parallel speed-up.
- `old`: `tasks.data.prepare_lm` of the code before prepared corpora (`git archive BASE tasks models kernels`), the path
  that held every line as a string and saved a compressed .npz (20 MB and 200 MB only: 1 GB needs ~23 GB).
- `read`: a worker process that builds the causal-LM task from the prepared corpus and draws training batches:
  its RSS (anonymous and file-backed parts) after building and after the batches, and batches/s; the same
  process times training steps of the smoke model (configs/smoke.yaml's mha) on those batches, so the ratio
  says whether the loader could starve the model.

    nice -n 10 python -m benchmarks.system.corpus_scale                      # 20 MB, 200 MB, 1 GB
    nice -n 10 python -m benchmarks.system.corpus_scale --sizes 1000 --old-sizes   # one size: replaces its row
    python -m benchmarks.system.corpus_scale --quick                         # 1 and 2 MB, a minute

Writes benchmarks/results/<machine>/corpus_scale.csv, corpus_scale_seconds.png and corpus_scale_memory_mb.png.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import plot_loglog, read_csv, results_dir, write_csv

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2"
MB = 1 << 20
SPEC = """name: corpus-scale
task: {{kind: clm, vocab_size: 8000, seq_len: 64, batch_size: 16,
        files: {{train: {train}, validation: {validation}}}}}
model: {{d_model: 64, layers: 2, ffn: 128, max_seq_len: 64, dropout: 0.1, attention: {{kind: mha, heads: 4}}}}
optim: {{lr: 2.0e-3, warmup_steps: 20, max_steps: 300, seed: 0}}
run: {{storage_path: {storage}}}
"""


def make_corpus(folder: Path, size_mb: int) -> Path:
    """WikiText-2 valid + test repeated to `size_mb` MB, cut at a line end."""
    path = folder / f"wikitext2x-{size_mb}MB.txt"
    if path.exists():
        return path
    block = (WIKITEXT / "valid.txt").read_bytes() + (WIKITEXT / "test.txt").read_bytes()
    target, written = size_mb * MB, 0
    with open(path.with_suffix(".tmp"), "wb") as f:
        while written + len(block) <= target:
            f.write(block)
            written += len(block)
        rest = block[: target - written]
        f.write(rest[: rest.rfind(b"\n") + 1])
    os.replace(path.with_suffix(".tmp"), path)
    return path


def measured(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd`; wall time, peak summed RSS and PSS of its process tree, peak RSS of the process itself."""
    import psutil

    start, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks = {"rss": 0, "pss": 0, "main_rss": 0}
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
                infos = [p.memory_full_info() for p in tree]
            except psutil.Error:
                infos = []
            if infos:
                peaks["rss"] = max(peaks["rss"], sum(i.rss for i in infos))
                peaks["pss"] = max(peaks["pss"], sum(i.pss for i in infos))
                peaks["main_rss"] = max(peaks["main_rss"], infos[0].rss)
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the process and the children it reaped
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    return {"seconds": time.monotonic() - start, "cpu_s": cpu_s, "peak_rss_mb": peaks["rss"] / MB,
            "peak_pss_mb": peaks["pss"] / MB, "main_rss_mb": peaks["main_rss"] / MB, "stdout": out}


def _train_manifest(storage: Path) -> dict[str, Any]:
    (manifest,) = (storage / ".cache" / "prepared").glob("lm-train-*/manifest.json")
    return json.loads(manifest.read_text())


def _train_tokens(storage: Path) -> int:
    return _train_manifest(storage)["columns"]["tokens"]["n_data"]


def _drop_prepared(storage: Path) -> None:
    for folder in (storage / ".cache" / "prepared").glob("lm-*"):
        shutil.rmtree(folder) if folder.is_dir() else folder.unlink()


def old_code(work: Path, base: str) -> Path:
    """tasks/ and models/ as of `base` (the in-memory .npz path), unpacked once."""
    folder = work / f"old-{base}"
    if not folder.exists():
        folder.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", base, "tasks", "models", "kernels"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


_OLD = """
import sys; from pathlib import Path; from pydantic import TypeAdapter
from tasks.config import TaskConfig; from tasks.data import prepare_lm
cfg = TypeAdapter(TaskConfig).validate_python({"kind": "clm", "vocab_size": 8000,
      "files": {"train": sys.argv[1], "validation": sys.argv[2]}})
prepare_lm(cfg, ("train", "validation"), Path(sys.argv[3]))
"""


def read_worker(spec_path: Path, batches: int, steps: int) -> dict[str, Any]:
    """In the reader process: build the task, draw batches, time smoke-model steps; RSS along the way."""
    from orchestrator.spec import load_spec
    from tasks import WorkerContext, build_task

    torch.set_num_threads(1)  # run.cpus_per_worker: 1 in the smoke spec

    def memory() -> dict[str, float]:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}

    spec = load_spec(str(spec_path), [])
    before = memory()
    task = build_task(spec.task, spec.model, WorkerContext(seed=0, cache_dir=Path(spec.run.storage_path) / ".cache"))
    built = memory()
    stream = task.train_batches()
    start = time.perf_counter()
    kept = [next(stream)[0] for _ in range(steps)]
    for _ in range(batches - steps):
        next(stream)
    batches_per_s = batches / (time.perf_counter() - start)
    after = memory()
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for i, batch in enumerate(kept):
        if i == 3:  # warm-up steps excluded
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        task.loss(model, batch).backward()
        optimizer.step()
    steps_per_s = (len(kept) - 3) / (time.perf_counter() - start)
    return {"reader_batches_per_s": batches_per_s, "smoke_steps_per_s": steps_per_s,
            "reader_rss_start_mb": before["VmRSS"], "reader_rss_built_mb": built["VmRSS"],
            "reader_rss_mb": after["VmRSS"], "reader_anon_mb": after["RssAnon"], "reader_file_mb": after["RssFile"]}


def run_size(size_mb: int, work: Path, old_sizes: Sequence[int], base: str, batches: int) -> dict[str, Any]:
    corpus = make_corpus(work, size_mb)
    storage = work / f"runs-{size_mb}MB"
    shutil.rmtree(storage, ignore_errors=True)
    spec = work / f"spec-{size_mb}MB.yaml"
    spec.write_text(SPEC.format(train=corpus, validation=WIKITEXT / "valid.txt", storage=storage))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "orchestrator", "prepare", str(spec)]
    # the machine is shared: its load while this size runs says how far the wall times can be trusted
    row: dict[str, Any] = {"corpus_mb": size_mb, "load_avg_1min": os.getloadavg()[0]}
    first = measured([*cli, "task.prepare_workers=2"], ROOT, env)
    row["train_tokens"] = tokens = _train_tokens(storage)
    row.update(prepare_s=first["seconds"], prepare_tok_per_s=tokens / first["seconds"],
               prepare_peak_rss_mb=first["peak_rss_mb"], prepare_peak_pss_mb=first["peak_pss_mb"],
               prepare_main_rss_mb=first["main_rss_mb"])
    for workers in (1, 2):
        _drop_prepared(storage)
        again = measured([*cli, f"task.prepare_workers={workers}"], ROOT, env)
        row[f"tokenise_{workers}_s"] = again["seconds"]
        # the train split's own pipeline (read, encode, write), without the process's start and the other split
        row[f"tokenise_{workers}_split_s"] = _train_manifest(storage)["seconds"]
        row[f"tokenise_{workers}_cpu_s"] = again["cpu_s"]
        row[f"tokenise_{workers}_tok_per_s"] = tokens / again["seconds"]
        row[f"tokenise_{workers}_peak_pss_mb"] = again["peak_pss_mb"]
    row["speedup_2_over_1"] = row["tokenise_1_s"] / row["tokenise_2_s"]
    row["split_speedup_2_over_1"] = row["tokenise_1_split_s"] / row["tokenise_2_split_s"]
    reader = measured([sys.executable, "-m", "benchmarks.system.corpus_scale", "--read", str(spec),
                       "--batches", str(batches)], ROOT, env)
    row.update(json.loads(reader["stdout"].strip().splitlines()[-1]))
    row["reader_over_step"] = row["reader_batches_per_s"] / row["smoke_steps_per_s"]
    if size_mb in old_sizes:
        old = measured([sys.executable, "-c", _OLD, str(corpus), str(WIKITEXT / "valid.txt"), str(work / f"old-cache-{size_mb}")],
                       old_code(work, base), {**os.environ, "PYTHONPATH": str(old_code(work, base))})
        shutil.rmtree(work / f"old-cache-{size_mb}", ignore_errors=True)
        row.update(old_s=old["seconds"], old_peak_rss_mb=old["peak_rss_mb"], old_peak_pss_mb=old["peak_pss_mb"],
                   speedup_over_old=old["seconds"] / row["prepare_s"])
    shutil.rmtree(storage, ignore_errors=True)
    print(json.dumps(row), flush=True)
    return row


SERIES = {  # (column, label, panel)
    "prepare_s": ("orchestrator prepare, 2 processes, from nothing", "seconds"),
    "tokenise_1_s": ("tokenise only, 1 process", "seconds"),
    "tokenise_2_s": ("tokenise only, 2 processes", "seconds"),
    "old_s": ("before: in-memory .npz", "seconds"),
    "prepare_peak_pss_mb": ("prepare: peak PSS, all processes", "memory_mb"),
    "prepare_peak_rss_mb": ("prepare: peak RSS summed over processes", "memory_mb"),
    "old_peak_rss_mb": ("before: peak RSS", "memory_mb"),
    "reader_rss_mb": ("reading worker: RSS", "memory_mb"),
}


def plot(rows: list[dict[str, Any]], path: Path) -> list[Path]:
    """Time, and memory, against corpus size: one figure each (the harness's log-log panel), a line per
    measurement."""
    out = []
    for panel, label, title in (("seconds", "seconds", "preparation time"), ("memory_mb", "MB", "memory")):
        long = [{"corpus_mb": r["corpus_mb"], "series": name, panel: r[column]}
                for r in rows for column, (name, where) in SERIES.items() if where == panel and column in r]
        out.append(plot_loglog(long, path.with_name(f"{path.stem}_{panel}.png"), x="corpus_mb", panels={panel: label},
                               series="series", title=f"corpus scale: {title} against corpus size (2-core CPU)",
                               columns=1))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 200, 1000], help="corpus sizes in MB")
    parser.add_argument("--old-sizes", type=int, nargs="*", default=[20, 200],
                        help="sizes also prepared by the code before prepared corpora")
    parser.add_argument("--base", default="f37659b", help="the commit of that code")
    parser.add_argument("--batches", type=int, default=3000, help="batches the reader draws")
    parser.add_argument("--work", type=Path, default=Path("/tmp/corpus_scale"), help="corpora and scratch folder")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--quick", action="store_true", help="1 and 2 MB corpora, 300 batches")
    parser.add_argument("--replot", action="store_true", help="only draw the plots again from the CSV")
    parser.add_argument("--read", type=Path, help=argparse.SUPPRESS)  # the reader process itself
    args = parser.parse_args(argv)
    if args.read:
        print(json.dumps(read_worker(args.read, args.batches, steps=23)))
        return
    if args.quick:
        args.sizes, args.old_sizes, args.batches = [1, 2], [1], 300
    folder = results_dir(args.out, torch.device("cpu"))
    path = folder / ("corpus_scale_quick.csv" if args.quick else "corpus_scale.csv")
    if args.replot:
        print(plot([_numbers(r) for r in read_csv(path)], path))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    rows = [run_size(size, args.work, args.old_sizes, args.base, args.batches) for size in args.sizes]
    # a size measured again replaces its row; the other sizes' rows stay (sizes can be run one at a time)
    kept = [_numbers(r) for r in read_csv(path) if int(r["corpus_mb"]) not in args.sizes] if path.exists() else []
    rows = sorted(kept + rows, key=lambda r: r["corpus_mb"])
    print(write_csv(rows, path))
    print(plot(rows, path.with_suffix(".png")))


def _numbers(row: dict[str, str]) -> dict[str, Any]:
    """A CSV row back to numbers (empty cells: the measurement was not made for that size)."""
    return {k: (int(v) if k == "corpus_mb" else float(v)) for k, v in row.items() if v != ""}


if __name__ == "__main__":
    main()
