"""A pretrained causal LM with drop-in efficient attention, scored on long documents (task.kind: pretrained_lm).

HyperAttention's patching experiment (Han et al. 2023, Sec. 4.1; the authors' benchmark_patch_llm.py): take a
trained long-context LM, replace the attention of some layers with a weight-free mechanism (models/dropin.py),
and measure what it costs in perplexity and gains in speed. Nothing is trained unless optim.max_steps > 0, in
which case the patched model is fine-tuned on task.files.train by the ordinary training core.

Documents and scoring. The evaluation split's text is tokenised whole (a Hugging Face tokenizer as the model's
own; an export's sentencepiece model line by line with EOS after each line, as its pretraining stream was made;
raw bytes for a byte-level export) and cut into consecutive, non-overlapping windows of task.seq_len tokens; the
remainder shorter than a window is dropped. Each window is one document, scored in one forward pass with no
context before it: its seq_len - 1 next-token predictions count, the first token is context only. Perplexity is
e^(sum of NLL / number of predictions), token-weighted over all documents. The authors' script reports
torch.exp2 of a loss in nats, 2^NLL, which is smaller than e^NLL: its numbers are not comparable with ours
(e^NLL = (2^NLL)^(1/ln 2)).

Speed. The same documents pass through the patched model and, with task.time_unpatched, through the unpatched
one (every layer exact, in the same process, after the patched pass, weights shared): wall time of the forward
passes and of the attention modules alone (forward hooks; CUDA synchronised around each). The first batch of
each pass is scored but not timed: it pays the one-time costs (Triton compiles and autotuning, cuBLAS and SDPA
set-up, the caching allocator's first blocks), which the patched pass, running first, would otherwise pay alone.
A pass of one batch runs it again, timed, its loss counted once. On CUDA the peak allocated memory of each pass
is reported as well (tasks/device_memory.py: GB of 1e9 bytes, without lowering the trainer's memory/peak_gb); on
CPU none is (the allocator does not track it).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.attention.exact import ExactMechanism
from models.dropin import patch_project_model
from models.exported import CONFIG_FILE, TOKENIZER_FILE, load_model, read_export_config
from models.hf_patching import attention_modules, mechanisms_detached, patch_hf_model
from tasks.base import Batch, WorkerContext
from tasks.device_memory import measured_peak
from tasks.pretrained_config import PretrainedLMTaskConfig
from tasks.long_range import read_bytes
from tasks.tokenizer import EOS_ID

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TRAIN_SEED = 7_207  # the order of training windows: fixed apart from the run seed


class PretrainedCausalLM(nn.Module):
    """A pretrained causal LM behind the project's model interface: forward(tokens [B, T]) -> logits [B, T, V],
    `attention_parameters()` and `parameter_counts()`, and the attention modules that timing hooks watch."""

    def __init__(self, model: nn.Module, hugging_face: bool):
        super().__init__()
        self.model, self.hugging_face = model, hugging_face
        self.train(model.training)  # a new module starts in training mode; the loaded model is in eval mode

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        if self.hugging_face:
            return self.model(input_ids=tokens_BT, use_cache=False).logits
        return self.model(tokens_BT)

    def attention_layers(self) -> list[nn.Module]:
        if self.hugging_face:
            return list(attention_modules(self.model).values())
        return [layer.attn for layer in self.model.stack.layers]

    def attention_parameters(self) -> int:
        return sum(p.numel() for module in self.attention_layers() for p in module.parameters())

    def parameter_counts(self) -> dict[str, int]:
        return {"attention": self.attention_parameters(), "total": sum(p.numel() for p in self.parameters())}

    def patch(self, cfg: PretrainedLMTaskConfig, seed: int) -> list[int]:
        """Patch the layers cfg.patch selects; the hashing seed is cfg.patch.attention.seed + the run's seed."""
        if self.hugging_face:
            return patch_hf_model(self.model, cfg.patch, seed_offset=seed)
        return patch_project_model(self.model, cfg.patch, seed_offset=seed)

    @contextlib.contextmanager
    def unpatched(self) -> Iterator[None]:
        """Every layer exact inside the block (the project's models get exact mechanisms back)."""
        if self.hugging_face:
            with mechanisms_detached(self.model):
                yield
            return
        held = [(layer.attn, layer.attn.mechanism) for layer in self.model.stack.layers]
        for attention, _ in held:
            attention.mechanism = ExactMechanism()
        try:
            yield
        finally:
            for attention, mechanism in held:
                attention.mechanism = mechanism


def _is_export(source: str) -> bool:
    return (Path(source).expanduser() / CONFIG_FILE).is_file()


def load_pretrained(cfg: PretrainedLMTaskConfig) -> tuple[PretrainedCausalLM, Callable[[Path], np.ndarray]]:
    """The model (unpatched, fp32 or cfg.dtype, eval mode, on the CPU) and the function that turns a text file
    into its token stream."""
    source = cfg.pretrained
    if _is_export(source):
        folder = Path(source).expanduser()
        config = read_export_config(folder)
        if config["architecture"] != "causal_lm":
            raise ValueError(f"task.pretrained={source} is an export of a {config['architecture']} model; "
                             "patching scores causal LMs (export a task.kind: clm or bytelm run)")
        model = load_model(folder).to(_DTYPES[cfg.dtype])
        tokenizer = folder / TOKENIZER_FILE
        if tokenizer.is_file():
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor(model_file=str(tokenizer))

            def encode(path: Path) -> np.ndarray:
                ids: list[int] = []
                for line in _read_text(path).splitlines():
                    if line.strip():
                        ids.extend(sp.encode(line.strip(), out_type=int) + [EOS_ID])
                return np.asarray(ids, dtype=np.int64)
        elif config["vocab_size"] == 256:
            def encode(path: Path) -> np.ndarray:
                return read_bytes(str(path), "task.files")
        else:
            raise ValueError(f"task.pretrained={source}: the export holds no {TOKENIZER_FILE} and is not byte-level")
        return PretrainedCausalLM(model, hugging_face=False), encode
    return _load_hugging_face(cfg)


def _load_hugging_face(cfg: PretrainedLMTaskConfig) -> tuple[PretrainedCausalLM, Callable[[Path], np.ndarray]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = cfg.pretrained
    local = Path(source).expanduser().is_dir()
    where = dict(local_files_only=local, trust_remote_code=cfg.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **where)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=_DTYPES[cfg.dtype], attn_implementation="sdpa",
                                                     **where)
    except OSError as err:
        raise ValueError(f"task.pretrained={source!r} could not be loaded ({str(err).splitlines()[0]}); give a local "
                         "Hugging Face folder (config.json, weights, tokenizer), an export folder of this project "
                         "(model.json), or a hub id on a machine that can reach the hub") from None

    def encode(path: Path) -> np.ndarray:
        return np.asarray(tokenizer(_read_text(path))["input_ids"], dtype=np.int64)

    return PretrainedCausalLM(model.eval(), hugging_face=True), encode


def _read_text(path: Path) -> str:
    import gzip

    raw = gzip.open(path, "rb").read() if str(path).endswith(".gz") else Path(path).read_bytes()
    return raw.decode("utf-8", errors="replace")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _AttentionClock:
    """Seconds spent inside the watched modules' forwards (nested calls counted once, at the outermost)."""

    def __init__(self, modules: list[nn.Module], device: torch.device):
        self.seconds, self.device, self._depth, self._start = 0.0, device, 0, 0.0
        self.timing = True  # off for a warm-up batch
        self._handles = [h for m in modules for h in (m.register_forward_pre_hook(self._enter),
                                                       m.register_forward_hook(self._leave))]

    def _enter(self, *_: Any) -> None:
        if self._depth == 0:
            _synchronize(self.device)
            self._start = time.perf_counter()
        self._depth += 1

    def _leave(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            _synchronize(self.device)
            if self.timing:
                self.seconds += time.perf_counter() - self._start

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class PretrainedLMTask:
    """The Task protocol (tasks/base.py) for a patched pretrained causal LM."""

    def __init__(self, cfg: PretrainedLMTaskConfig, model_cfg: Any, ctx: WorkerContext):
        self.cfg, self.ctx = cfg, ctx
        self.metrics = cfg.metrics
        self._model, self._encode = load_pretrained(cfg)
        eval_file = Path(getattr(cfg.files, cfg.eval_split))
        self.eval_stream = self._encode(eval_file)
        self._train_stream: np.ndarray | None = None
        self.patched_layers: list[int] = []
        if len(self.eval_stream) < cfg.seq_len:
            raise ValueError(f"task.files.{cfg.eval_split} holds {len(self.eval_stream)} tokens, fewer than one "
                             f"document of task.seq_len={cfg.seq_len}; lower task.seq_len or give a longer file")

    def build_model(self) -> nn.Module:
        """The pretrained model, patched (built once per task: it is loaded from disk, not initialised)."""
        model, self._model = self._model, None
        if model is None:
            model, _ = load_pretrained(self.cfg)
        self.patched_layers = model.patch(self.cfg, self.ctx.seed)
        return model

    def documents(self, stream: np.ndarray, limit: int | None) -> np.ndarray:
        """[N, seq_len] consecutive windows of `stream` (the remainder dropped), the first `limit`."""
        n = len(stream) // self.cfg.seq_len
        if limit is not None:
            n = min(n, limit)
        return stream[: n * self.cfg.seq_len].reshape(n, self.cfg.seq_len)

    # ---- fine-tuning (optim.max_steps > 0)

    def train_batches(self, position: dict[str, Any] | None = None) -> Iterator[tuple[Batch, dict[str, Any]]]:
        if self._train_stream is None:
            self._train_stream = self._encode(Path(self.cfg.files.train))
        windows = self.documents(self._train_stream, None)
        if len(windows) == 0:
            raise ValueError(f"task.files.train holds fewer than task.seq_len={self.cfg.seq_len} tokens")
        epoch, index = (0, 0) if position is None else (position["epoch"], position["index"])
        rank, world = self.ctx.rank, self.ctx.world_size
        while True:
            order = np.random.default_rng([_TRAIN_SEED, self.ctx.seed, epoch]).permutation(len(windows))[rank::world]
            while index + self.cfg.batch_size <= len(order):
                rows = order[index: index + self.cfg.batch_size]
                index += self.cfg.batch_size
                tokens = torch.from_numpy(windows[rows])
                yield Batch({"tokens": tokens}, tokens.numel() - len(rows)), {"epoch": epoch, "index": index}
            epoch, index = epoch + 1, 0

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self._nll_sum(model, batch.tensors["tokens"]) / max(batch.n_tokens, 1)

    @staticmethod
    def _nll_sum(model: nn.Module, tokens_BT: torch.Tensor) -> torch.Tensor:
        logits_BTV = model(tokens_BT)
        return F.cross_entropy(logits_BTV[:, :-1].flatten(0, 1).float(), tokens_BT[:, 1:].flatten(), reduction="sum")

    # ---- evaluation

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Perplexity of the patched model over the documents, and the time of it against the unpatched one."""
        model = getattr(model, "module", model)
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        limit = self.cfg.documents
        if self.cfg.eval_batches is not None:
            limit = min(limit or 1 << 62, self.cfg.eval_batches * self.cfg.batch_size)
        docs = self.documents(self.eval_stream, limit)
        patched = self._score(model, docs, device)
        metrics = {"val/loss": patched["loss"], "val/ppl": math.exp(min(patched["loss"], 50.0)),
                   "val/patched_layers": float(len(self.patched_layers)),
                   "val/forward_s": patched["forward_s"], "val/attention_s": patched["attention_s"],
                   "val/timed_documents": patched["timed_documents"],
                   "val/documents": float(len(docs)), "val/tokens": float(docs.size)}
        if "peak_gb" in patched:
            metrics["val/peak_gb"] = patched["peak_gb"]
        if self.cfg.time_unpatched:
            with model.unpatched():
                exact = self._score(model, docs, device)
            metrics.update({
                "val/ppl_unpatched": math.exp(min(exact["loss"], 50.0)),
                "val/forward_s_unpatched": exact["forward_s"], "val/attention_s_unpatched": exact["attention_s"],
                "val/speedup": exact["forward_s"] / max(patched["forward_s"], 1e-12),
                "val/attention_speedup": exact["attention_s"] / max(patched["attention_s"], 1e-12)})
            if "peak_gb" in exact:
                metrics["val/peak_gb_unpatched"] = exact["peak_gb"]
        model.train(was_training)
        return metrics

    def _score(self, model: PretrainedCausalLM, docs: np.ndarray, device: torch.device) -> dict[str, float]:
        """Mean NLL over every document; seconds over the timed documents (all but the first batch's)."""
        starts = list(range(0, len(docs), self.cfg.batch_size))
        # The first batch is the warm-up (scored, not timed); a lone batch runs again for its time, not its loss.
        runs = [(start, True) for start in starts] + ([(0, False)] if len(starts) == 1 else [])
        total, count, forward_s, timed = 0.0, 0, 0.0, 0
        with (contextlib.closing(_AttentionClock(model.attention_layers(), device)) as clock,
              measured_peak(device) as peak):
            for i, (start, scored) in enumerate(runs):
                clock.timing = i > 0
                tokens = torch.from_numpy(docs[start: start + self.cfg.batch_size]).to(device)
                _synchronize(device)
                began = time.perf_counter()
                nll = self._nll_sum(model, tokens)
                _synchronize(device)
                if clock.timing:
                    forward_s += time.perf_counter() - began
                    timed += tokens.shape[0]
                if scored:
                    total += float(nll)
                    count += tokens.numel() - tokens.shape[0]
        out = {"loss": total / count, "forward_s": forward_s, "attention_s": clock.seconds,
               "timed_documents": float(timed)}
        if peak.gb is not None:
            out["peak_gb"] = peak.gb
        return out

    def artifacts(self) -> dict[str, Path]:
        return {}
