"""The method table of `dspark bench sweep`: a method name → the `--speculative-config` JSON that
`dspark serve` gets for it. Not run directly (see `dspark.bench.sweep`).

A name is `BASE[-kN][-POLICY]`, parts separated by "-":
- BASE: `none` (no speculation), `ngram` (prompt lookup), or a drafter method `dspark`, `dflash`,
  `eagle3`, `draft_model` (these need a drafter checkpoint: `--drafter-dir METHOD=PATH`, else the
  one `dspark.drafters.shipped` ships for the target model; without either the method is skipped);
- `kN`: num_speculative_tokens = N, length policy `fixed` unless a policy part follows
  (`dspark-k3`, `dspark-k7`, `ngram-k4`);
- POLICY: `fixed`, `threshold`, `prefix` or `async` (`dspark-prefix`, `dspark-async`; all but
  `fixed` need a confidence head, so dspark only); `prefix` and `async` read the cost table
  that `dspark profile` writes once per sweep (`needs_cost_table`);
- `lookup`: prompt lookup first, the drafter where lookup cannot do better (`"ngram_first": true`;
  drafter methods only: `dspark-prefix-lookup`, `dspark-k3-lookup`);
- `unswitched`: without the measured switch (`"measured_switch": false`; prefix and async only, the
  policies with a draft gate: `dspark-prefix-lookup-unswitched`), to measure the switch side by side.
Plain `ngram` drafts NGRAM_DEFAULT_TOKENS tokens from matches of NGRAM_LOOKUP tokens; plain drafter methods use `SpecConfig`'s
default γ.

Example: `method_spec(parse_method("dspark-k3"), drafter_dir="ckpt/dspark")`
→ `{"method": "dspark", "model": "ckpt/dspark", "num_speculative_tokens": 3,
    "length_policy": "fixed"}`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.config import LENGTH_POLICY_NAMES
from dspark.drafters.methods import method_names

NO_SPEC = "none"
DRAFTER_METHODS = ("dspark", "dflash", "eagle3", "draft_model")
COST_TABLE_POLICIES = ("prefix", "async")
CONFIDENCE_METHODS = ("dspark",)  # adaptive policies need a confidence head (engine/build.py)
NGRAM_DEFAULT_TOKENS = 4
NGRAM_LOOKUP = (2, 5)  # prompt_lookup_min / max of the `ngram` method
LOOKUP_PART = "lookup"
UNSWITCHED_PART = "unswitched"


class MethodUnavailable(Exception):
    """The method cannot run here (no drafter checkpoint); the sweep skips it with this message."""


@dataclass(frozen=True)
class Method:
    """A parsed method name."""

    name: str
    base: str  # none | ngram | dspark | dflash | eagle3 | draft_model
    num_speculative_tokens: int | None = None  # None: the method's default
    length_policy: str | None = None  # None: SpecConfig's default (fixed)
    ngram_first: bool = False  # the `lookup` part
    measured_switch: bool = True  # False: the `unswitched` part

    @property
    def needs_drafter(self) -> bool:
        return self.base in DRAFTER_METHODS

    @property
    def needs_cost_table(self) -> bool:
        return self.length_policy in COST_TABLE_POLICIES


def parse_method(name: str) -> Method:
    """`dspark-k3` → Method(base="dspark", num_speculative_tokens=3, length_policy="fixed")."""
    base, *parts = name.strip().split("-")
    if base != NO_SPEC and base not in method_names():
        raise ValueError(f"method {name!r}: unknown base {base!r}; "
                         f"choose from {', '.join((NO_SPEC, *method_names()))}")
    num_tokens, policy, lookup, switch = None, None, False, True
    for part in parts:
        if part.startswith("k") and part[1:].isdigit() and int(part[1:]) >= 1:
            num_tokens = int(part[1:])
        elif part in LENGTH_POLICY_NAMES:
            policy = part
        elif part == LOOKUP_PART:
            lookup = True
        elif part == UNSWITCHED_PART:
            switch = False
        else:
            raise ValueError(f"method {name!r}: part {part!r} is neither kN, {LOOKUP_PART!r}, {UNSWITCHED_PART!r} "
                             f"nor a length policy ({', '.join(LENGTH_POLICY_NAMES)})")
    if base == NO_SPEC and parts:
        raise ValueError(f"method {name!r}: 'none' takes no options")
    if lookup and base not in DRAFTER_METHODS:
        raise ValueError(f"method {name!r}: {LOOKUP_PART!r} wraps a drafter ({', '.join(DRAFTER_METHODS)})")
    if policy not in (None, "fixed") and base not in CONFIDENCE_METHODS:
        raise ValueError(f"method {name!r}: length policy {policy!r} needs a confidence head "
                         f"({', '.join(CONFIDENCE_METHODS)})")
    if num_tokens is not None and policy is None:
        policy = "fixed"
    if not switch and policy not in COST_TABLE_POLICIES:
        raise ValueError(f"method {name!r}: {UNSWITCHED_PART!r} needs a policy with a draft gate "
                         f"({', '.join(COST_TABLE_POLICIES)})")
    return Method(name, base, num_tokens, policy, lookup, switch)


def method_spec(method: Method, *, drafter_dir: str | None = None,
                cost_table_path: str | None = None) -> dict | None:
    """The speculative config dict for `method` (None for `none`); raises `MethodUnavailable`."""
    if method.base == NO_SPEC:
        return None
    spec: dict = {"method": method.base}
    if method.needs_drafter:
        if not drafter_dir:
            raise MethodUnavailable(f"{method.name}: no drafter checkpoint for {method.base!r} "
                                    f"(pass --drafter-dir {method.base}=PATH)")
        spec["model"] = drafter_dir
    num_tokens = method.num_speculative_tokens
    if num_tokens is None and method.base == "ngram":
        num_tokens = NGRAM_DEFAULT_TOKENS
    if num_tokens is not None:
        spec["num_speculative_tokens"] = num_tokens
    if method.base == "ngram":  # the match lengths the sweeps were measured with (vLLM's default is 5..5)
        spec |= {"prompt_lookup_min": NGRAM_LOOKUP[0], "prompt_lookup_max": NGRAM_LOOKUP[1]}
    if method.length_policy is not None:
        spec["length_policy"] = method.length_policy
    if method.ngram_first:
        spec["ngram_first"] = True
    if not method.measured_switch:
        spec["measured_switch"] = False
    if method.needs_cost_table:
        if not cost_table_path:
            raise MethodUnavailable(f"{method.name}: length policy {method.length_policy!r} "
                                    "needs a cost table")
        spec["cost_table"] = cost_table_path
    return spec


def shipped_drafter_dir(model: str, base: str) -> str | None:
    """The drafter checkpoint `dspark.drafters.shipped` provides for `model` and method `base`, or
    None when nothing is shipped for that pair."""
    from dspark.drafters.shipped import drafter_dir
    found = drafter_dir(model, base)
    return str(found) if found else None


def parse_drafter_dirs(items: list[str] | None) -> dict[str, str]:
    """`["dspark=ckpt/a", "eagle3=ckpt/b"]` → {"dspark": "ckpt/a", "eagle3": "ckpt/b"}; a method
    name with options (`dspark-k3=PATH`) applies to that method only."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, path = item.partition("=")
        if not sep or not key or not path:
            raise ValueError(f"--drafter-dir {item!r}: expected METHOD=PATH")
        out[key.strip()] = path.strip()
    return out
