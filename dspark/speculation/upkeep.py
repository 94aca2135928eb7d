"""Online upkeep of the adaptive-verification inputs from live traffic (`"online_upkeep": true` in
the speculative config; off by default).

Two things drift away from their offline values while serving, and both feed the length policies:

* **The cost table.** The engine times every step (prepare + target forward + verification
  sampling) together with its number of batched tokens B. Each observation is assigned to the
  profiled point nearest to B (in log scale) and kept as an exponential moving average of the ratio
  measured seconds / table seconds at B, so memory is one number per profiled point. Every
  `refresh_every` steps each point with enough samples moves by `blend` toward ratio × its time;
  a single refresh changes a point by at most `max_step_factor`, and a point never leaves
  [1/max_drift_factor, max_drift_factor] × its profiled time. The profiled grid is kept, so the
  table stays the shape the scheduler was tuned on; the change is logged.
* **The per-position confidence temperatures** (reference §7.5). Each verified round's conditional
  outcomes are fed to `OnlineCalibrator`; the raw logit is recovered from the confidence the
  drafter emitted as z_k = T_k · (logit(c_k) − b_k), with the temperatures in force when it was
  proposed (b_k: the offline STS shifts, 0 unless fitted; kept fixed online).
  Outcomes are buffered per step and fed once per step, so a refit (and the new temperatures pushed
  into the drafter's `confidence_temperatures`) happens only between steps, never while drafts
  proposed under the old temperatures are being counted. A drafter with a separate greedy fit
  (`greedy_confidence_temperatures`) gets a second calibrator fed by greedy requests only.

With `UpkeepConfig(enabled=False)` every call is a no-op: the table and the temperatures stay as
loaded.

    pytest tests/test_scheduled_verification.py -q -k upkeep
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from dspark.speculation.calibration import OnlineCalibrationConfig, OnlineCalibrator, STSCalibration
from dspark.speculation.cost_table import CostTable

__all__ = ["UpkeepConfig", "OnlineUpkeep"]

log = logging.getLogger(__name__)

_MAX_ABS_LOGIT = 30.0  # σ saturates in float32 well before this; keeps inverted logits finite


@dataclass(frozen=True)
class UpkeepConfig:
    enabled: bool = True
    refresh_every: int = 64  # steps between cost-table refreshes
    ema_decay: float = 0.9  # weight of the old ratio in each point's moving average
    min_samples: int = 4  # observations a point needs before a refresh moves it
    blend: float = 0.5  # fraction of the way toward the measured time per refresh
    max_step_factor: float = 2.0  # one refresh changes a point's time by at most this factor
    max_drift_factor: float = 8.0  # a point stays within this factor of its profiled time
    calibration: OnlineCalibrationConfig = field(default_factory=OnlineCalibrationConfig)

    def __post_init__(self) -> None:
        if self.refresh_every < 1 or self.min_samples < 1:
            raise ValueError("refresh_every and min_samples must be >= 1")
        if not 0.0 <= self.ema_decay < 1.0 or not 0.0 < self.blend <= 1.0:
            raise ValueError("need 0 <= ema_decay < 1 and 0 < blend <= 1")
        if self.max_step_factor < 1.0 or self.max_drift_factor < 1.0:
            raise ValueError("max_step_factor and max_drift_factor must be >= 1")


class OnlineUpkeep:
    """Engine-facing: `observe_verify` is an the engine's `spec.verify_observers` callback; `observe_step`
    is called once per step with its size and wall time and returns the cost table to use next."""

    def __init__(self, *, drafter=None, cost_table: CostTable | None = None,
                 config: UpkeepConfig | None = None, is_greedy: Callable[[str], bool] | None = None) -> None:
        self.config = config or UpkeepConfig()
        self.drafter = drafter
        self.cost_table = cost_table
        self.profiled = cost_table  # the drift bound is relative to this
        num_points = len(cost_table.num_tokens) if cost_table else 0
        self._ratio = torch.ones(num_points, dtype=torch.float64)  # [num_points] EMA measured/table
        self._samples = torch.zeros(num_points, dtype=torch.long)  # [num_points] since last refresh
        self._num_steps = 0
        # one calibrator per temperature tensor the drafter applies: requests that sample, and greedy
        # requests when the drafter keeps a separate greedy fit (`greedy_confidence_temperatures`)
        self.is_greedy = is_greedy
        self.calibrators: dict[bool, tuple[OnlineCalibrator, torch.Tensor]] = {}  # greedy? → (fit, tensor)
        temps = getattr(drafter, "confidence_temperatures", None)
        if drafter is not None and getattr(drafter, "has_confidence", False) and temps is not None:
            shifts = getattr(drafter, "biases_for", None)  # the offline shifts, held fixed online

            def calibrated(greedy: bool, tensor: torch.Tensor) -> tuple[OnlineCalibrator, torch.Tensor]:
                biases = None if shifts is None else tuple(float(b) for b in shifts(greedy))
                initial = STSCalibration(temperatures=tuple(float(t) for t in tensor), biases=biases)
                return OnlineCalibrator(num_positions=len(tensor), config=self.config.calibration,
                                        initial=initial), tensor

            greedy_temps = getattr(drafter, "greedy_confidence_temperatures", temps)
            self.calibrators[False] = calibrated(False, temps)
            self.calibrators[True] = (self.calibrators[False] if greedy_temps is temps
                                      else calibrated(True, greedy_temps))
        self.calibrator = self.calibrators[False][0] if self.calibrators else None
        # this step's rounds: (greedy?, raw logits, num_verified, num_accepted)
        self._rounds: list[tuple[bool, list[float], int, int]] = []
        if self.config.enabled:
            every = f"refreshed every {self.config.refresh_every} steps"
            log.info("online upkeep on: cost table %s; confidence temperatures %s",
                     every if cost_table else "absent",
                     "recalibrated" if self.calibrator else "absent (no confidence head)")

    # -- verification outcomes -------------------------------------------------------------------
    def observe_verify(self, request_id: str, draft_confidence: list[float] | None,
                       num_verified: int, num_accepted: int) -> None:
        if not (self.config.enabled and self.calibrator is not None and draft_confidence
                and num_verified):
            return
        greedy = bool(self.is_greedy and self.is_greedy(request_id))
        calibration = self.calibrators[greedy][0].calibration
        temps = calibration.temperatures
        conf = torch.tensor(draft_confidence[:len(temps)], dtype=torch.float64)
        conf = conf.clamp(1e-13, 1 - 1e-13)  # [num_proposed]
        shift = torch.tensor([calibration.bias(k) for k in range(conf.numel())], dtype=torch.float64)
        logits = (torch.logit(conf) - shift) * torch.tensor(temps[:conf.numel()], dtype=torch.float64)
        self._rounds.append((greedy, logits.clamp(-_MAX_ABS_LOGIT, _MAX_ABS_LOGIT).tolist(),
                             int(num_verified), int(num_accepted)))

    # -- step timings ----------------------------------------------------------------------------
    def observe_step(self, *, num_tokens: int, seconds: float) -> CostTable | None:
        """Record one step; returns the (possibly refreshed) cost table."""
        if not self.config.enabled:
            return self.cost_table
        self._flush_rounds()
        if self.cost_table is None or num_tokens < 1 or not seconds > 0:
            return self.cost_table
        point = self._nearest_point(num_tokens)
        ratio = seconds * self.cost_table.sps(num_tokens)  # measured / table seconds
        decay = self.config.ema_decay if self._samples[point] else 0.0
        self._ratio[point] = decay * self._ratio[point] + (1 - decay) * ratio
        self._samples[point] += 1
        self._num_steps += 1
        if self._num_steps % self.config.refresh_every == 0:
            self.refresh()
        return self.cost_table

    def refresh(self) -> CostTable | None:
        """Blend the moving averages into the table (bounded); logs the points that moved."""
        table, cfg = self.cost_table, self.config
        if table is None:
            return None
        ready = self._samples >= cfg.min_samples  # [num_points]
        if not bool(ready.any()):
            return table
        seconds = 1.0 / torch.tensor(table.steps_per_second, dtype=torch.float64)  # [num_points]
        profiled = 1.0 / torch.tensor(self.profiled.steps_per_second, dtype=torch.float64)
        factor = (1 - cfg.blend) + cfg.blend * self._ratio  # [num_points]
        factor = factor.clamp(1 / cfg.max_step_factor, cfg.max_step_factor)
        new_seconds = torch.where(ready, seconds * factor, seconds)
        new_seconds = torch.minimum(torch.maximum(new_seconds, profiled / cfg.max_drift_factor),
                                    profiled * cfg.max_drift_factor)
        self.cost_table = dataclasses.replace(
            table, steps_per_second=(1.0 / new_seconds).tolist(),
            meta={**table.meta, "online_refreshes": int(table.meta.get("online_refreshes", 0)) + 1})
        moved = [(b, old, new) for b, old, new in zip(table.num_tokens, table.steps_per_second,
                                                       self.cost_table.steps_per_second)
                 if abs(math.log(new / old)) > 1e-3]
        if moved:
            log.info("online upkeep: cost table SPS %s", ", ".join(
                f"B={b}: {old:.3g}->{new:.3g}" for b, old, new in moved))
        # ratios were measured against the old table: restart them against the new one
        self._ratio.fill_(1.0)
        self._samples.zero_()
        return self.cost_table

    # -- helpers ---------------------------------------------------------------------------------
    def _flush_rounds(self) -> None:
        rounds, self._rounds = self._rounds, []
        done: set[int] = set()
        for calibrator, temps in self.calibrators.values():
            if id(calibrator) in done:  # one fit shared by both regimes
                continue
            done.add(id(calibrator))
            mine = [r[1:] for r in rounds if self.calibrators[r[0]][0] is calibrator]
            if not mine:
                continue
            logits = torch.zeros(len(mine), calibrator.num_positions, dtype=torch.float64)  # [rounds, γ]
            for i, (row, _, _) in enumerate(mine):
                logits[i, :len(row)] = torch.tensor(row, dtype=torch.float64)
            num_verified = torch.tensor([v for _, v, _ in mine])
            num_accepted = torch.tensor([a for _, _, a in mine])
            before = calibrator.temperatures
            calibrator.update(logits=logits, num_verified=num_verified, num_accepted=num_accepted)
            if calibrator.temperatures != before:
                temps.copy_(torch.tensor(calibrator.temperatures[:temps.numel()], dtype=temps.dtype))

    def _nearest_point(self, num_tokens: int) -> int:
        points = torch.tensor(self.cost_table.num_tokens, dtype=torch.float64).log()
        return int((points - math.log(num_tokens)).abs().argmin())
