"""The Gated DeltaNet window kernel (dspark/kernels/cpu_ops_recurrent.inc, `GatedDeltaNet._windows_kernel`) against
its torch twin (`GatedDeltaNet._windows`: causal_conv, prepare_qk, delta_rule_tokens, LayerState.keep): one token and
windows of 2..8 for several requests at once (different slots and starts; sources in the ring, in a snapshot entry
and zeros; a window as long as the ring, which overwrites its own source entry), key heads repeated to value heads,
fp32 and bf16 activations and conv states; the output rows, the conv and recurrent state after every position, the
ring's bookkeeping and the snapshot saves compared. Then a tiny Qwen3.5 target's greedy decode and speculative
verification token for token with the kernel and with the torch path, and checks that the kernel is what runs
when it is available (and the twin when the kernels are off).

Tolerance. The conv, the q/k normalisation and the gating are torch's operations in torch's order; with bf16
activations the kernel rounds where torch's bf16 ops round (each conv product, its sum, the SiLU), so q, k and v
are torch's values up to the last bit of an exp. The delta rule sums S^T k and S^T q over dk in another order
than torch's reductions and fuses the multiply-adds, so a token's new state and output differ from the twin's by
about one fp32 rounding of the state's size (|k| = 1 after the normalisation, so the sums are no larger than
|S|), and the per-token map (a decay <= 1 and I - beta k k^T with 0 < beta < 1) does not amplify what came
before: after n tokens the difference is at most about n ulps of max |S|. The states here stay below 8
(ulp 2^-21 ~ 4.8e-7), so 8 tokens give STATE_ATOL = 4e-6; bf16 outputs are compared within one bf16 rounding.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dspark import kernels
from dspark.config import SpecConfig
from dspark.kernels import recurrent as recurrent_kernel
from dspark.models import qwen3_next
from dspark.models.qwen3_next import GatedDeltaNet
from dspark.models.recurrent import StateRows, allocate_layer_state
from tests.engine_helpers import greedy, make_engine, run, tiny_target
from tests.test_hybrid import TINY_QWEN3_5, ScriptedDrafter, _prompts

needs_kernel = pytest.mark.skipif(not recurrent_kernel.available(),
                                  reason="CPU kernels unavailable (DSPARK_CPU_KERNELS=0 or no compiler)")
STATE_ATOL, STATE_RTOL = 4e-6, 0.0
WINDOW = 8  # the ring: 1 + up to 7 drafts
# (key heads, value heads, key head dim, value head dim): the tiny model's (8 columns: one at a time with 16 lanes),
# 56 columns (whole column blocks, a one-vector block, and with 16 lanes 8 columns one at a time), and the real
# models' 128 x 128 heads
SHAPES = {"tiny": (2, 4, 8, 8), "gqa_tail": (1, 2, 32, 56), "full": (2, 2, 128, 128)}


def _layer(shape: tuple[int, int, int, int], dtype: torch.dtype) -> GatedDeltaNet:
    hk, hv, dk, dv = shape
    cfg = replace(TINY_QWEN3_5, linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                  linear_value_head_dim=dv)
    layer = GatedDeltaNet(cfg, dtype=dtype, device="cpu")
    with torch.no_grad():
        layer.conv_weight.copy_(torch.randn(layer.conv_weight.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    return layer


def _state(layer: GatedDeltaNet, conv_dtype: torch.dtype, seed: int):
    """A ring of WINDOW states per slot with random contents, slot s holding positions 5 + s .. 4 + s + WINDOW, and
    two snapshot entries (entry 1 holds the state after position 11)."""
    g = torch.Generator().manual_seed(seed)
    st = allocate_layer_state(num_slots=4, window=WINDOW, dtype=conv_dtype, device="cpu", num_snapshots=2,
                              **layer.state_shape())
    st.conv.copy_(torch.randn(st.conv.shape, generator=g))
    st.recurrent.copy_(torch.randn(st.recurrent.shape, generator=g))
    st.snap_conv.copy_(torch.randn(st.snap_conv.shape, generator=g))
    st.snap_recurrent.copy_(torch.randn(st.snap_recurrent.shape, generator=g))
    for s in range(4):
        st.kept(s, 5 + s, WINDOW)
    st.snap_positions[1] = 11
    return st


def _rows(n: int) -> StateRows:
    """Four requests: slot 2 from its ring (start 12, a snapshot save at its last position), slot 0 from zeros
    (start 0), slot 3 from snapshot entry 1 (start 12), and slot 1 with a window as long as the ring (start 8: its
    last state goes to the entry its source was read from)."""
    lengths = (n, n, n, WINDOW)
    offsets = tuple(sum(lengths[:i]) for i in range(4))
    return StateRows(slots=(2, 0, 3, 1), starts=(12, 0, 12, 8), lengths=lengths, offsets=offsets,
                     sources=(-1, -1, 1, -1), saves=(((12 + n - 1, 0),), (), (), ()))


def _inputs(layer: GatedDeltaNet, T: int, dtype: torch.dtype, seed: int):
    """(qkv [T, conv_dim], g, beta [T, Hv]): qkv a strided view of the columns of an in_proj-like output."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(T, layer.conv_dim + layer.value_dim + 2 * layer.num_v_heads, generator=g).to(dtype)
    gate = -2 * torch.rand(T, layer.num_v_heads, generator=g)  # log-decays
    return proj[:, :layer.conv_dim], gate, torch.rand(T, layer.num_v_heads, generator=g)


def _both(layer: GatedDeltaNet, rows: StateRows, dtype: torch.dtype, conv_dtype: torch.dtype, seed: int):
    """The kernel's and the twin's (core [T, Hv, dv], state) after the windows of `rows`."""
    T = sum(rows.lengths)
    qkv, gate, beta = _inputs(layer, T, dtype, seed)
    out = []
    for use_kernel in (True, False):
        st = _state(layer, conv_dtype, seed)
        core = torch.zeros(T, layer.num_v_heads, layer.head_v_dim, dtype=dtype)
        members = list(range(len(rows.lengths)))
        with torch.inference_mode():
            if use_kernel:
                assert layer._windows_kernel(members, qkv, gate, beta, rows, st, core)
            else:
                for n in sorted(set(rows.lengths)):
                    layer._windows(n, [r for r in members if rows.lengths[r] == n], qkv, gate, beta, rows, st, core)
        out.append((core, st))
    return out


@needs_kernel
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("n", range(1, 9))
def test_windows_match_the_torch_twin_fp32(shape, n):
    layer = _layer(SHAPES[shape], torch.float32)
    (core, st), (core_ref, st_ref) = _both(layer, _rows(n), torch.float32, torch.float32, seed=n)
    assert st_ref.recurrent.abs().max() < 8  # the size STATE_ATOL assumes
    torch.testing.assert_close(core, core_ref, atol=STATE_ATOL, rtol=STATE_RTOL)
    # every position's state, in every ring entry (the untouched ones unchanged), and the snapshot saved
    torch.testing.assert_close(st.recurrent, st_ref.recurrent, atol=STATE_ATOL, rtol=STATE_RTOL)
    assert torch.equal(st.conv, st_ref.conv)  # the conv states are the inputs themselves
    torch.testing.assert_close(st.snap_recurrent, st_ref.snap_recurrent, atol=STATE_ATOL, rtol=STATE_RTOL)
    assert torch.equal(st.snap_conv, st_ref.snap_conv)
    assert st.positions == st_ref.positions and st.snap_positions == st_ref.snap_positions == [12 + n - 1, 11]


@needs_kernel
@pytest.mark.parametrize("conv_dtype", [torch.bfloat16, torch.float32], ids=["bf16_states", "fp32_states"])
@pytest.mark.parametrize("shape", ["tiny", "full"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_windows_match_the_torch_twin_bf16(shape, n, conv_dtype):
    layer = _layer(SHAPES[shape], torch.bfloat16)
    (core, st), (core_ref, st_ref) = _both(layer, _rows(n), torch.bfloat16, conv_dtype, seed=10 + n)
    assert core.dtype == torch.bfloat16
    torch.testing.assert_close(core.float(), core_ref.float(), atol=STATE_ATOL, rtol=2 ** -8)  # one bf16 rounding
    torch.testing.assert_close(st.recurrent, st_ref.recurrent, atol=STATE_ATOL, rtol=STATE_RTOL)
    assert torch.equal(st.conv, st_ref.conv) and torch.equal(st.snap_conv, st_ref.snap_conv)
    assert st.positions == st_ref.positions


@needs_kernel
def test_a_window_equals_its_tokens_one_step_at_a_time():
    """Bit for bit: the state after each position of a window of 8 is the state a run of 8 one-token steps keeps (the
    kernel's arithmetic for a token does not depend on the window around it), so a rollback into a window resumes
    exactly where plain decoding would be."""
    layer = _layer(SHAPES["full"], torch.float32)
    rows = _rows(8)
    (core, st), _ = _both(layer, rows, torch.float32, torch.float32, seed=3)
    qkv, gate, beta = _inputs(layer, sum(rows.lengths), torch.float32, 3)
    one = _state(layer, torch.float32, 3)
    core_one = torch.zeros_like(core)
    with torch.inference_mode():
        for t in range(8):  # request 0 (slot 2, start 12) alone, token by token
            step = StateRows(slots=(2,), starts=(12 + t,), lengths=(1,), offsets=(t,))
            assert layer._windows_kernel([0], qkv, gate, beta, step, one, core_one)
    i = [(12 + t) % WINDOW for t in range(8)]
    assert torch.equal(one.recurrent[2, i], st.recurrent[2, i]) and torch.equal(one.conv[2, i], st.conv[2, i])
    assert torch.equal(core_one[:8], core[:8])


@needs_kernel
def test_the_kernel_refuses_two_requests_in_one_slot_and_a_window_past_the_ring():
    layer = _layer(SHAPES["tiny"], torch.float32)
    st = _state(layer, torch.float32, 0)
    qkv, g = torch.randn(10, layer.conv_dim), -torch.rand(10, layer.num_v_heads)
    core = torch.zeros(10, layer.num_v_heads, layer.head_v_dim)
    args = (st.conv, st.recurrent, st.snap_conv, st.snap_recurrent)
    with pytest.raises(RuntimeError, match="two requests in slot 2"):
        recurrent_kernel.gated_delta_windows(qkv, g, g.exp(), layer.conv_weight, *args,
                                             [(2, 12, 1, 0, 3, -1), (2, 13, 1, 1, 4, -1)], 2, core)
    with pytest.raises(RuntimeError, match="does not fit the rings"):
        recurrent_kernel.gated_delta_windows(qkv, g, g.exp(), layer.conv_weight, *args,
                                             [(2, 12, WINDOW + 1, 0, 3, -1)], 2, core)


# -- a whole tiny Qwen3.5 target ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_target(TINY_QWEN3_5)[0]


def _outputs(model, speculate: bool, plain: list[list[int]] | None = None) -> list[list[int]]:
    prompts = _prompts(4)
    kw = {}
    if speculate:  # windows of 5 ending in a rejection at every position in turn
        kw = {"drafter": ScriptedDrafter([p + o for p, o in zip(prompts, plain)]),
              "spec": SpecConfig(method="ngram", num_speculative_tokens=4)}
    return run(make_engine(model, TINY_QWEN3_5, budget=16, prefix=False, **kw), prompts, greedy(12))


@needs_kernel
def test_greedy_and_speculative_outputs_equal_the_torch_path(target, monkeypatch):
    fast_plain = _outputs(target, False)
    fast_spec = _outputs(target, True, fast_plain)
    monkeypatch.setattr(recurrent_kernel, "windows_apply", lambda *a: False)  # the torch twin, all else the same
    assert _outputs(target, False) == fast_plain
    assert _outputs(target, True, fast_plain) == fast_spec == fast_plain


@needs_kernel
def test_the_kernel_runs_every_window_when_available(target, monkeypatch):
    """Decode and verification windows never reach the torch twin while the kernel is there; each linear layer's
    windows of a step go through one kernel call."""
    calls = []
    kernel = recurrent_kernel.gated_delta_windows

    def counted(*args, **kw):
        calls.append(len(args[8]))  # the rows
        assert kernel(*args, **kw)
        return True

    def twin(*args, **kw):
        raise AssertionError("a window ran the torch twin although the kernel is available")
    monkeypatch.setattr(recurrent_kernel, "gated_delta_windows", counted)
    monkeypatch.setattr(GatedDeltaNet, "_windows", twin)
    monkeypatch.setattr(qwen3_next, "delta_rule_tokens", twin)
    plain = _outputs(target, False)
    _outputs(target, True, plain)
    assert calls and max(calls) == 4  # steps of all four requests' windows together


def test_with_the_kernels_off_the_twin_runs(target, monkeypatch):
    monkeypatch.setattr(kernels, "ops", lambda: None)  # what DSPARK_CPU_KERNELS=0 gives
    ran = []
    windows = GatedDeltaNet._windows
    monkeypatch.setattr(GatedDeltaNet, "_windows", lambda self, *a: ran.append(a[0]) or windows(self, *a))
    assert not recurrent_kernel.available()
    _outputs(target, False)
    assert ran
