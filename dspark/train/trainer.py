"""One training loop for every drafter (DSpark, DFlash, EAGLE-3), run by `dspark train` (see cli.py).

Per optimizer step and per micro-batch: next global batch from the data cursor → this rank's slice →
target taps online (features.py) → anchors → drafter.training_forward → loss (methods.py, losses.py) →
backward. Then the gradients are summed over ranks, clipped, and AdamW + warm-up/cosine take a step.

Distributed (torchrun / several processes, gloo on CPU): every rank draws the same global batch and
takes its slice; anchor seeds depend on the sample and the step, never on the rank; loss denominators
are global sums, so the summed gradient equals the single-process gradient of the global batch. (The
drafter is not wrapped in DistributedDataParallel: its training entry point is `training_forward`,
not `forward`, and the loss is already globally normalised.)

Checkpoints (every ckpt_every steps, the last keep_checkpoints kept) hold the trainable weights, the
optimizer, scheduler, RNG states, the data cursor and the draft vocabulary, so `--resume` continues
bit for bit. Frozen weights (embedding, LM head) come from the target and are not stored. With
select_by "tau_process" the weights of the best validation by tau_process (the starting weights' own
validation included) are kept in checkpoints/best.pt, and export writes those instead of the last.

    trainer = Trainer(cfg, data_dir="data/smollm2_train", out_dir="runs/dspark1")
    trainer.fit(resume=True); trainer.export("runs/dspark1/export")
"""

from __future__ import annotations

import json
import logging
import math
import random
import resource
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dspark.train import methods
from dspark.train.config import TrainConfig
from dspark.drafters.vocab import build_draft_vocab, vocab_coverage
from dspark.train.data import (BatchSampler, Cursor, TokenDataset, check_feature_caches, collate,
                               token_counts)
from dspark.train.features import FeatureCache, ShardedFeatureCache, batch_features, noisy_taps
from dspark.train.losses import add_stats, summarise

log = logging.getLogger("dspark.train")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sum_all(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t)
    return t


PROBE_SKIP, PROBE_STEPS = 20, 30  # schedule_by_time: skip the first steps (warm-up: on a GPU they run slow), time these


def lr_lambda(step: int, *, total: int, warmup_frac: float, min_lr_frac: float) -> float:
    """Linear warm-up over warmup_frac of the steps, then cosine down to min_lr_frac (reference §4.5)."""
    warmup = max(1, round(total * warmup_frac))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, cfg: TrainConfig, *, data_dir: str | Path, out_dir: str | Path, target=None,
                 cache_dir: str | Path | None = None, show_progress: bool = True):
        """target: (model, ModelConfig, eos_ids) to skip loading cfg.model (tests inject tiny models)."""
        self.cfg, self.out_dir = cfg, Path(out_dir)
        check_feature_caches(data_dir, cfg.feature_cache)  # before any weights load
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.show_progress = show_progress and self.rank == 0
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._log_handler = logging.FileHandler(self.out_dir / "train.log")
            self._log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            log.addHandler(self._log_handler)
            log.setLevel(logging.INFO)
        if target is None:
            from dspark.models.loader import load_model
            model, target_cfg, tok = load_model(cfg.model, dtype=DTYPES[cfg.target_dtype], device=cfg.device)
            target = (model, target_cfg, tuple(tok.eos_token_ids))
        self.target, self.target_cfg, eos_ids = target
        self.target.requires_grad_(False)
        self.train_ds = TokenDataset(data_dir, split="train", max_seq_len=cfg.max_seq_len)
        val = TokenDataset(data_dir, split="val", max_seq_len=cfg.max_seq_len)
        self.val_ds = val if len(val) else None
        init = methods.load_export(cfg, cfg.init_from, self.target) if cfg.init_from else None
        self.d2t = self._draft_vocab(eos_ids, init)
        torch.manual_seed(cfg.seed)
        self.model, self.draft_cfg = methods.build(cfg, self.target, self.target_cfg, self.d2t)
        if init is not None:
            methods.copy_trainable(init, self.model, where=cfg.init_from, grow=cfg.init_grow)
        self.device = torch.device(cfg.device)
        self.model.to(self.device)
        self.tap_layer_ids = tuple(self.draft_cfg.tap_layer_ids)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           eps=1e-8, weight_decay=cfg.weight_decay)
        self.total_steps = cfg.max_steps  # the schedule's length (schedule_by_time: fitted to max_minutes)
        self.schedule_fitted = False
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, total=self.total_steps, warmup_frac=cfg.warmup_frac,
                                                min_lr_frac=cfg.min_lr_frac))
        self.sampler = BatchSampler(num_samples=len(self.train_ds), global_batch=cfg.batch_size * self.world,
                                    seed=cfg.seed)
        self.cache = FeatureCache(cache_dir, tap_layer_ids=self.tap_layer_ids) if cache_dir else None
        if cfg.feature_cache:
            self.cache = ShardedFeatureCache(cfg.feature_cache, tap_layer_ids=self.tap_layer_ids,
                                             target_dtype=cfg.target_dtype)
        # draft-vocab rows of the target's LM head: per-step target logits from cached hidden states
        head = self.target.lm_head.dense_weight().detach()
        self.head_rows = head if self.d2t is None else head[self.d2t.to(head.device)].contiguous()
        self.step, self.cursor = 0, Cursor()
        self.focus: list[torch.Tensor] | None = None  # anchor_focus: per train sample, mined on first use
        self._best_tau: float | None = None  # select_by tau_process: checkpoints/best.pt's score, read once
        if self.rank == 0:
            n_train = sum(p.numel() for p in self.params)
            log.info("train %s: %d trainable params, %d train / %d val sequences (%d tokens), world %d, "
                     "config %s", cfg.method, n_train, len(self.train_ds), len(val), self.train_ds.num_tokens(),
                     self.world, json.dumps(asdict(cfg)))

    # -- draft vocabulary -----------------------------------------------------------------------------
    def _draft_vocab(self, eos_ids: tuple[int, ...], init=None) -> torch.Tensor | None:
        """The draft -> target id map (None: the full vocabulary): a warm start's own (its LM-head rows and
        heads are indexed by it), else the draft_vocab_size most frequent tokens of the data plus EOS."""
        vocab, size = self.target_cfg.vocab_size, self.cfg.draft_vocab_size
        if size is None or size >= vocab:
            return None
        if init is not None:
            d2t, source = init.d2t.detach().clone().long(), f"from {self.cfg.init_from}"
            if d2t.numel() != size:
                raise ValueError(f"init_from {self.cfg.init_from!r} has a {d2t.numel()}-token draft vocabulary; "
                                 f"the config asks for draft_vocab_size {size}")
        else:
            counts = token_counts(self.train_ds, vocab_size=vocab)
            d2t, source = build_draft_vocab(counts, size=size, always=tuple(eos_ids)), "built from the data"
        if self.rank == 0:
            cov = vocab_coverage(token_counts(self.train_ds, vocab_size=vocab, assistant_only=True), d2t)
            log.info("draft vocab %s: %d of %d tokens cover %.2f%% of the assistant tokens", source, d2t.numel(),
                     vocab, 100 * cov)
            (self.out_dir / "draft_vocab.json").write_text(json.dumps({"coverage": cov, "d2t": d2t.tolist()}))
        return d2t

    # -- one optimizer step -----------------------------------------------------------------------------
    def _anchor_seeds(self, indices: list[int], micro: int) -> list[int]:
        base = (self.cfg.seed * 1_000_003 + self.step) * 131 + micro
        return [(base * 2_654_435_761 + i * 40_503) % (2 ** 63 - 1) for i in indices]

    def _micro_batch(self, micro: int):
        indices, self.cursor = self.sampler.next_batch(self.cursor)
        mine = indices[self.rank * self.cfg.batch_size:(self.rank + 1) * self.cfg.batch_size]
        batch = collate([self.train_ds[i] for i in mine])
        return batch, self._anchor_seeds(batch.indices, micro)

    def _focus_anchors(self) -> list[torch.Tensor]:
        """anchor_focus: every train sample's process anchors under the starting weights, mined once (every
        rank the same) and kept in out_dir/focus_anchors.pt, so a resumed run reads the same ones."""
        path = self.out_dir / "focus_anchors.pt"
        if path.exists():
            return torch.load(path, map_location="cpu", weights_only=True)
        focus: list[torch.Tensor] = []
        tokens = 0  # answer tokens (each emitted once by the replay)
        self.model.eval()
        for start in range(0, len(self.train_ds), self.cfg.batch_size):
            batch = collate([self.train_ds[i] for i in range(start, min(start + self.cfg.batch_size,
                                                                        len(self.train_ds)))])
            feats = batch_features(self.target, batch=batch, tap_layer_ids=self.tap_layer_ids, cache=self.cache)
            with self._autocast():
                anchors, emitted = methods.focus_anchors(self.model, batch, feats)
            focus += anchors
            tokens += emitted
        self.model.train()
        rounds = sum(f.numel() for f in focus)
        if self.rank == 0:
            log.info("anchor focus: %d process anchors mined over %d sequences (tau_process %.3f)", rounds,
                     len(focus), tokens / max(rounds, 1))
            torch.save(focus, path)
        return focus

    def _loss(self, batch, seeds):
        if self.cfg.anchor_focus and self.focus is None:
            self.focus = self._focus_anchors()
        focus = None if self.focus is None else [self.focus[i] for i in batch.indices]
        t0 = time.perf_counter()
        feats = batch_features(self.target, batch=batch, tap_layer_ids=self.tap_layer_ids, cache=self.cache)
        t1 = time.perf_counter()
        batch, feats = self._on_device(batch, feats)
        if self.cfg.feature_noise:
            feats = noisy_taps(feats, num_taps=len(self.tap_layer_ids), scale=self.cfg.feature_noise, seed=seeds[0])
        with self._autocast():
            out = methods.batch_loss(self.cfg, self.model, self.target, batch, feats, d2t=self.d2t, seeds=seeds,
                                     all_reduce=_sum_all, head_rows=self.head_rows, focus=focus)
        out.stats["t_target_s"] = torch.tensor([t1 - t0])  # target forward (taps), per rank
        return out

    def _autocast(self):
        """bf16 autocast on the training device when drafter_autocast asks for it; off the CPU also the device
        as the default for new tensors (the method code creates its masks and indices without one)."""
        import contextlib
        stack = contextlib.ExitStack()
        if self.device.type != "cpu":
            stack.enter_context(self.device)
        if self.cfg.drafter_autocast == "bfloat16":
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        return stack

    def _on_device(self, batch, feats):
        """(batch, features) moved to the training device (unchanged on the CPU)."""
        if self.device.type == "cpu":
            return batch, feats
        from dataclasses import replace
        dev = self.device
        batch = replace(batch, input_ids=batch.input_ids.to(dev), loss_mask=batch.loss_mask.to(dev),
                        lengths=batch.lengths.to(dev))
        feats = replace(feats, taps=feats.taps.to(dev), hidden=feats.hidden.to(dev),
                        lse=None if feats.lse is None else feats.lse.to(dev))
        return batch, feats

    def precompute_features(self) -> dict | None:
        """Fill the sharded feature cache (config feature_cache) with every train + val sample, once.
        Rank 0 computes; other ranks wait and re-read the index."""
        if not isinstance(self.cache, ShardedFeatureCache):
            return None
        samples = list(self.train_ds.samples) + (list(self.val_ds.samples) if self.val_ds is not None else [])
        record = None
        if self.rank == 0 and any(s.key not in self.cache for s in samples):
            record = self.cache.precompute(self.target, samples, tap_layer_ids=self.tap_layer_ids,
                                           tokens_per_forward=self.cfg.feature_tokens_per_forward,
                                           progress=self.show_progress, log=log)
        if self.world > 1:
            dist.barrier()
            self.cache.refresh()
        return record

    def compute_grads(self) -> dict[str, torch.Tensor]:
        """Forward + backward over grad_accum micro-batches, gradients summed over ranks; returns stats."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, torch.Tensor] = {}
        for micro in range(self.cfg.grad_accum):
            out = self._loss(*self._micro_batch(micro))
            (out.loss / self.cfg.grad_accum).backward()
            add_stats(stats, out.stats)
        if self.world > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
        return stats

    def train_step(self) -> dict[str, torch.Tensor]:
        stats = self.compute_grads()
        stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip).detach().view(1)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return stats

    # -- loop ----------------------------------------------------------------------------------------
    def fit(self, *, resume: bool = False, stop_at: int | None = None) -> dict:
        """Train to cfg.max_steps (or stop_at, for tests of interruption); returns the last log record."""
        if resume:
            self.load_checkpoint()
        self.precompute_features()
        if self._selects_best() and self.step == 0:
            self.evaluate()  # the starting weights are a candidate (a warm start may already be the best)
        end = min(self.total_steps, stop_at or self.total_steps)
        bar = None
        if self.show_progress:
            from tqdm import tqdm
            bar = tqdm(total=self.cfg.max_steps, initial=self.step, desc=f"train {self.cfg.method}", unit="step")
        window: dict[str, torch.Tensor] = {}
        record: dict = {}
        t_window = time.perf_counter()
        steps_in_window = 0
        deadline = None if self.cfg.max_minutes is None else time.monotonic() + 60 * self.cfg.max_minutes
        # schedule_by_time: the steps [probe_from, probe_from + PROBE_STEPS) are timed, from probe_t0
        probe_from = self.step + PROBE_SKIP if self.cfg.schedule_by_time and not self.schedule_fitted else None
        probe_t0 = None
        while self.step < end:
            if deadline is not None and time.monotonic() >= deadline:
                log.info("max_minutes %.1f reached at step %d", self.cfg.max_minutes, self.step)
                break
            if self.step == probe_from:
                probe_t0 = time.monotonic()
            elif probe_t0 is not None and self.step == probe_from + PROBE_STEPS:
                end = min(end, self._fit_schedule((time.monotonic() - probe_t0) / PROBE_STEPS, deadline))
                probe_from = probe_t0 = None
                if bar:
                    bar.total = self.total_steps
            add_stats(window, self.train_step())
            steps_in_window += 1
            if bar:
                bar.update(1)
            if self.step % self.cfg.log_every == 0 or self.step == end:
                record = self._log_record(window, steps_in_window, time.perf_counter() - t_window)  # no "val"
                if bar:
                    bar.set_postfix(ce=f"{record.get('ce', 0):.3f}", tau=f"{record['tau_top1']:.2f}")
                window, steps_in_window, t_window = {}, 0, time.perf_counter()
            if self.val_ds is not None and self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
                record["val"] = self.evaluate()
            if self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0 and self.step < end:
                self.save_checkpoint()
        if bar:
            bar.close()
        if self.val_ds is not None and "val" not in record:
            record["val"] = self.evaluate()
        self.save_checkpoint()
        return record

    def _fit_schedule(self, seconds_per_step: float, deadline: float) -> int:
        """schedule_by_time: the lr schedule spans the steps that fit before the deadline at the probed rate
        (90% of them: evaluations and checkpoints take their share), max_steps the cap; returns the new end."""
        fit = self.step + int(0.9 * (deadline - time.monotonic()) / max(seconds_per_step, 1e-6))
        self.total_steps, self.schedule_fitted = max(self.step + 1, min(self.cfg.max_steps, fit)), True
        log.info("schedule_by_time: %.3f s a step, the schedule spans %d steps", seconds_per_step, self.total_steps)
        return self.total_steps

    def _log_record(self, window, num_steps: int, seconds: float) -> dict:
        window = {k: _sum_all(v) for k, v in window.items()}
        grad_norm = float(window.pop("grad_norm").sum()) / max(1, num_steps) / self.world
        t_target = float(window.pop("t_target_s").sum()) / max(1, num_steps) / self.world
        record = {"step": self.step, "lr": self.scheduler.get_last_lr()[0], **summarise(window),
                  "grad_norm": grad_norm, "s_per_step": seconds / max(1, num_steps), "s_target_per_step": t_target,
                  "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}
        if self.rank == 0:
            log.info("step %d %s", self.step, json.dumps(record))
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out split on rank 0: the first eval_batches batches, fixed anchors (same every call)."""
        if self.rank != 0:
            return {}
        self.model.eval()
        size = min(len(self.val_ds), self.cfg.batch_size)
        sampler = BatchSampler(num_samples=len(self.val_ds), global_batch=size, seed=0)
        cursor, stats, process = Cursor(), {}, [0, 0]  # process: tokens, rounds (tau_process)
        for _ in range(min(self.cfg.eval_batches, sampler.steps_per_epoch())):
            indices, cursor = sampler.next_batch(cursor)
            batch = collate([self.val_ds[i] for i in indices])
            cache = self.cache if isinstance(self.cache, ShardedFeatureCache) else None
            feats = batch_features(self.target, batch=batch, tap_layer_ids=self.tap_layer_ids, cache=cache)
            batch, feats = self._on_device(batch, feats)
            with self._autocast():
                out = methods.batch_loss(self.cfg, self.model, self.target, batch, feats, d2t=self.d2t,
                                         seeds=[10_007 * i + 1 for i in batch.indices], all_reduce=lambda t: t,
                                         head_rows=self.head_rows)
            add_stats(stats, out.stats)
            if self.cfg.eval_process_tau:
                with self._autocast():
                    counts = methods.process_tau_counts(self.cfg, self.model, batch, feats, d2t=self.d2t)
                process[0] += counts[0]
                process[1] += counts[1]
        record = {"step": self.step, "split": "val", **summarise(stats)}
        if process[1]:
            record["tau_process"] = process[0] / process[1]
        log.info("val %s", json.dumps(record))
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._selects_best() and "tau_process" in record:
            self._keep_if_best(record["tau_process"])
        return record

    # -- selection by tau_process ----------------------------------------------------------------------
    def _selects_best(self) -> bool:
        return self.cfg.select_by == "tau_process" and self.val_ds is not None and self.rank == 0

    def _best_path(self) -> Path:
        return self.out_dir / "checkpoints" / "best.pt"

    def _keep_if_best(self, tau: float) -> None:
        """Store the current trainable weights as checkpoints/best.pt when tau beats the stored best (a
        tie keeps the earlier step)."""
        path = self._best_path()
        if self._best_tau is None and path.exists():  # a resumed run: the best so far is on disk
            self._best_tau = torch.load(path, map_location="cpu", weights_only=True)["tau_process"]
        if self._best_tau is not None and self._best_tau >= tau:
            return
        self._best_tau = tau
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"step": self.step, "tau_process": tau, "model": self._trainable_state()}, tmp)
        tmp.rename(path)
        log.info("best tau_process %.4f at step %d", tau, self.step)

    # -- checkpoints -----------------------------------------------------------------------------------
    def _trainable_state(self) -> dict[str, torch.Tensor]:
        frozen = {n for n, p in self.model.named_parameters() if not p.requires_grad}
        return {k: v.clone() for k, v in self.model.state_dict().items() if k not in frozen}

    def save_checkpoint(self) -> Path | None:
        if self.rank != 0:
            if self.world > 1:
                dist.barrier()
            return None
        ckpt_dir = self.out_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step, "cursor": asdict(self.cursor), "config": asdict(self.cfg),
            "model": self._trainable_state(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "d2t": self.d2t, "world": self.world,
            "schedule": {"total_steps": self.total_steps, "fitted": self.schedule_fitted},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_rng_state()},
        }
        path = ckpt_dir / f"step-{self.step:07d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.rename(path)
        for old in sorted(ckpt_dir.glob("step-*.pt"))[:-self.cfg.keep_checkpoints]:
            old.unlink()
        log.info("checkpoint %s", path)
        if self.world > 1:
            dist.barrier()
        return path

    def load_checkpoint(self, path: str | Path | None = None) -> bool:
        if path is None:
            found = sorted((self.out_dir / "checkpoints").glob("step-*.pt"))
            if not found:
                log.info("resume: no checkpoint in %s, starting fresh", self.out_dir)
                return False
            path = found[-1]
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values: no pickle
        if state["world"] != self.world:
            raise ValueError(f"checkpoint was written by {state['world']} ranks; resuming with {self.world} "
                             f"changes the global batch and the data order")
        for key in ("method", "batch_size", "draft_vocab_size", "seed"):
            if state["config"][key] != getattr(self.cfg, key):
                raise ValueError(f"checkpoint {key}={state['config'][key]!r} differs from config "
                                 f"{getattr(self.cfg, key)!r}")
        if (state["d2t"] is None) != (self.d2t is None) or (
                self.d2t is not None and not torch.equal(state["d2t"], self.d2t)):
            raise ValueError("checkpoint draft vocabulary differs from the one built from this data")
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        frozen = {n for n, p in self.model.named_parameters() if not p.requires_grad}
        if unexpected or set(missing) - frozen:
            raise ValueError(f"checkpoint does not fit the drafter: missing {sorted(set(missing) - frozen)}, "
                             f"unexpected {unexpected}")
        self.optimizer.load_state_dict(state["optimizer"])
        schedule = state.get("schedule", {"total_steps": self.cfg.max_steps, "fitted": False})
        self.total_steps, self.schedule_fitted = schedule["total_steps"], schedule["fitted"]
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        _set_numpy_rng_state(state["rng"]["numpy"])
        self.step, self.cursor = state["step"], Cursor(**state["cursor"])
        log.info("resumed from %s at step %d", path, self.step)
        return True

    def export(self, path: str | Path) -> None:
        """The drafter checkpoint the engine loads (config.json + model.safetensors) and the training
        config next to it."""
        if self.rank != 0:
            return
        step = self.step
        if self._selects_best() and self._best_path().exists():
            best = torch.load(self._best_path(), map_location="cpu", weights_only=True)
            self.model.load_state_dict(best["model"], strict=False)  # trainable weights only
            step = best["step"]
            log.info("select_by tau_process: exporting step %d (tau_process %.4f) of %d", step,
                     best["tau_process"], self.step)
        methods.export(self.cfg, self.model, self.draft_cfg, path)
        Path(path, "train_config.json").write_text(json.dumps({**asdict(self.cfg), "_exported_step": step}, indent=2))
        log.info("exported %s drafter to %s", self.cfg.method, path)

    def close(self) -> None:
        if self.rank == 0:
            log.removeHandler(self._log_handler)
            self._log_handler.close()


def _numpy_rng_state() -> dict:
    """numpy's global RNG state as a tensor and plain values (a checkpoint `torch.load(weights_only=True)`
    reads: no numpy objects, no pickle)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_numpy_rng_state(state: dict) -> None:
    np.random.set_state((state["name"], state["keys"].numpy().astype(np.uint32), state["pos"],
                         state["has_gauss"], state["cached_gaussian"]))
