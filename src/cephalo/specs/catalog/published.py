"""Published per-layer profiles (`_data/catalog.json`, converted by `scripts/build_catalog.py`
from the Cephalo authors' measurements, MIT: `_data/LICENSE`) turned into the `DeviceProfile`
the cost model reads (`catalog_profile`); a model without published profiles gets FLOP-scaled
block times (`flop_scaling`) and the estimate's measured error."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

from cephalo.errors import CephaloError
from cephalo.specs.catalog.derived import DERIVED, DerivationError
from cephalo.specs.catalog.devices import (
    DTYPES,
    MEASURED_DEVICES,
    device_memory_bytes,
    host_copy_bytes_per_s,
    optimizer_s_per_param,
    resolve_device_type,
)
from cephalo.specs.catalog.flop_scaling import (
    LeaveOneOut,
    Published,
    estimate,
    group_of,
    leave_one_out,
)
from cephalo.specs.catalog.formulas import (
    block_flops_per_sample,
    boundary_activation_bytes,
    embedding_time_ratio,
    head_logits_bytes,
    head_time_ratio,
    korthikanti_block_activation_bytes,
)
from cephalo.specs.catalog.models import MODELS, _model_spec, get_model_spec, model_shape
from cephalo.specs.model import ModelSpec
from cephalo.specs.profile import Curve, DeviceProfile, UnitProfile

CATALOG_PATH = Path(__file__).parents[2] / "_data" / "catalog.json"


# ---------------------------------------------------------------------- shipped data
@cache
def _catalog() -> dict:
    try:
        return json.loads(CATALOG_PATH.read_text())
    except (OSError, ValueError) as e:  # a broken install, not a user error, but say so clearly
        raise CephaloError(
            f"cannot read the packaged catalog {CATALOG_PATH}: {e}; reinstall cephalo"
        ) from e


def published_total_params(model: str) -> int | None:
    """Total parameters the authors published for this model (model_stats.json), if any."""
    return _catalog()["published_params"].get(model_shape(model).name, {}).get("total_parameters")


def published_params_per_layer(model: str) -> int | None:
    return (
        _catalog()["published_params"].get(model_shape(model).name, {}).get("parameters_per_layer")
    )


def skipped_entries() -> list[dict]:
    """Entries of the published data the converter did not use, each with a `reason`."""
    return list(_catalog()["skipped"])


def available_profiles() -> list[tuple[str, str, int, str]]:
    """(model, device_type, seq_len, data dtype `fp16`|`fp32`) for every measured block timing."""
    out = []
    for model, by_dev in _catalog()["timings"].items():
        for dev, by_seq in by_dev.items():
            for seq, by_dtype in by_seq.items():
                out.extend((model, dev, int(seq), dtype) for dtype in by_dtype)
    return sorted(out)


def _timing_entry(model: str, device: str, seq_len: int, dtype: str) -> tuple[dict, int]:
    """The measured block timing for (model, device, dtype) and the seq_len it was measured
    at: the exact seq_len if present, else the nearest one (by ratio) of the same dtype."""
    data_dtype = "fp32" if dtype == "fp32" else "fp16"
    by_seq = _catalog()["timings"].get(model, {}).get(device, {})
    seqs = sorted(int(s) for s, by_dtype in by_seq.items() if data_dtype in by_dtype)
    if not seqs:
        have = [f"{d}/{s}/{t}" for m, d, s, t in available_profiles() if m == model]
        raise CephaloError(
            f"no published {data_dtype} profile of {model} on {device}"
            + (" (bf16 uses the fp16 data)" if dtype == "bf16" else "")
            + f". Published for {model} (device/seq_len/dtype): {', '.join(have) or 'none'}."
            " Choose one of those, or measure your devices with `cephalo profile`."
        )
    nearest = min(seqs, key=lambda s: abs(math.log(s / seq_len)))
    return by_seq[str(nearest)][data_dtype], nearest


def block_activation_bytes_per_sample(
    spec: ModelSpec, seq_len: int, dtype: str
) -> tuple[float, str]:
    """Peak extra memory of recomputing + backpropagating one block, per sample, and its source.

    Where the authors profiled memory (model_memory.json: peak allocated minus training
    state, with recomputation, at batch 1..k), the slope of that line per sample covers one
    block's recompute activations + every layer's boundary activation + the head's logits.
    Subtracting the two known parts leaves the block's share. That measurement was made at
    the data's sequence length (512) and is scaled to `seq_len` with the Korthikanti formula's
    ratio. The result never goes below the formula (a measurement smaller than theory means
    the subtraction over-counted), and the formula alone is used where nothing was measured.
    """
    formula = korthikanti_block_activation_bytes(spec, seq_len, dtype)
    mem = _catalog()["memory"].get(spec.name, {}).get("fp32" if dtype == "fp32" else "fp16")
    if mem is None:
        return formula, "formula"
    s0 = mem["seq_len"]
    per_sample = mem["slope_bytes_per_sample"]
    block0 = (
        per_sample
        - spec.num_layers * boundary_activation_bytes(spec, s0, dtype)
        - head_logits_bytes(spec, s0, dtype)
    )
    measured = block0 * formula / korthikanti_block_activation_bytes(spec, s0, dtype)
    return (measured, "measured") if measured > formula else (formula, "formula")


# Curves are evaluated at these micro-batch sizes when a unit's curve is a multiple of a
# per-sample constant (activation memory is linear in the micro-batch).
_ACT_XS = [1.0, 2.0, 4.0, 8.0, 16.0]


def _scaled(curve: Curve, factor: float) -> Curve:
    return Curve(list(curve.xs), [y * factor for y in curve.ys])


def _linear_bytes(per_sample: float) -> Curve:
    return Curve(list(_ACT_XS), [per_sample * x for x in _ACT_XS])


def _data_dtype(dtype: str) -> str:
    return "fp32" if dtype == "fp32" else "fp16"


def _block_shape(spec: ModelSpec) -> tuple[int, int, int]:
    return (spec.params_per_block, spec.hidden_size, spec.num_heads)


def timed_model_for(spec: ModelSpec) -> str | None:
    """The catalog model whose published block timings describe `spec`'s blocks: itself, or
    one with the same block shape (a transformers Llama-2-7B directory is llama2-7b's
    blocks); None when no published model has these blocks."""
    timings = _catalog()["timings"]
    if spec.name in timings:
        return spec.name
    if spec.num_experts:  # no published model routes tokens to experts: FLOP-scaled
        return None
    for name in timings:
        if name in MODELS and _block_shape(_model_spec(MODELS[name])) == _block_shape(spec):
            return name
    return None


@cache
def published_entries(
    device: str, dtype: str, measured_only: bool = False
) -> tuple[Published, ...]:
    """Every published block timing on `device` in `dtype`'s data (bf16 reads fp16); with
    `measured_only`, without the entries derived from a sibling card (`specs.catalog.derived`)."""
    out = []
    for name, by_dev in _catalog()["timings"].items():
        if name not in MODELS:
            continue
        spec = _model_spec(MODELS[name])
        for seq, by_dtype in by_dev.get(device, {}).items():
            entry = by_dtype.get(_data_dtype(dtype))
            if entry is not None and not (measured_only and entry["source"] == "derived"):
                out.append(
                    Published(
                        name,
                        _block_shape(spec),
                        group_of(spec.arch),
                        int(seq),
                        block_flops_per_sample(spec, int(seq)),
                        Curve.from_dict(entry["fwd_s"]),
                        Curve.from_dict(entry["bwd_s"]),
                    )
                )
    return tuple(out)


@cache
def estimate_error(device: str | None, dtype: str | None, group: str) -> LeaveOneOut | None:
    """Leave-one-out error of the FLOP-scaled estimate for `group` blocks on `device` in
    `dtype`; with `device` / `dtype` None, pooled over every GPU and dtype of the catalog."""
    devices = [device] if device else sorted(MEASURED_DEVICES)  # derived cards repeat them
    dtypes = [dtype] if dtype else ["fp16", "fp32"]
    # measured entries only: a derived entry's error is the derivation's (printed beside it)
    return leave_one_out(
        [published_entries(d, t, measured_only=True) for d in devices for t in dtypes], group
    )


def _estimated_block(
    spec: ModelSpec, device: str, seq_len: int, dtype: str
) -> tuple[Curve, Curve, dict]:
    """Block curves of a model without published profiles, by FLOP scaling (flop_scaling.py),
    and what to tell the user about them."""
    candidates = published_entries(device, dtype)
    if not candidates:
        raise CephaloError(
            f"{device} has no published {_data_dtype(dtype)} profiles to estimate {spec.name} "
            "from; measure your devices with `cephalo profile`"
        )
    group = group_of(spec.arch)
    est = estimate(block_flops_per_sample(spec, seq_len), group, seq_len, candidates)
    here = estimate_error(device, dtype, group)
    overall = estimate_error(None, None, group)
    timings = _catalog()["timings"]
    from_derived = any(
        timings[m][device][seq][_data_dtype(dtype)].get("source") == "derived"
        for m, seq in (src.split("@") for src in est.sources)
    )
    meta = {
        "timing_source": "flop-scaled",
        "estimated_from": ", ".join(est.sources) + (" (derived entries)" if from_derived else ""),
        "estimate_group": group,
        "estimate_error": (here or overall).describe() if (here or overall) else "not measurable",
        "estimate_error_scope": f"{device} {_data_dtype(dtype)}" if here else "all catalog GPUs",
    }
    return est.fwd, est.bwd, meta


def derived_meta(device: str) -> dict:
    """What a plan says about a derived card: its method and the method's measured error."""
    info = _catalog()["derived"][device]
    err = _catalog()["derivation_errors"].get(info["error_scope"])
    return {
        "derived_method": info["method"],
        "derived_error_scope": info["error_scope"],
        "derived_fills_gaps": bool(info.get("fills_gaps")),
        "derived_error": DerivationError.from_dict(err).describe() if err else "not measurable",
    }


def catalog_profile(
    device_type: str, model: ModelSpec | str, seq_len: int, dtype: str
) -> DeviceProfile:
    """The cost model's view of `device_type` running `model` at (seq_len, dtype), from the
    published measurements.

    Block forward/backward times are the measured curves (seconds vs micro-batch) of the
    model, or of a published model with the same blocks. A missing seq_len is served from
    the nearest measured one, scaled linearly in tokens (an approximation: attention's share
    grows quadratically, a few percent at these lengths). A catalog model's missing dtype is
    an error that lists what exists. A model the catalog never measured (a transformers
    directory, a preset) gets block times estimated from the same GPU's published profiles
    by FLOP scaling (`_estimated_block`; its leave-one-out error is in the profile's meta).
    Embedding and head times are the block's times x `embedding_time_ratio` /
    `head_time_ratio`.
    """
    if dtype not in DTYPES:
        raise CephaloError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if seq_len <= 0:
        raise CephaloError(f"seq_len must be positive, got {seq_len}")
    spec = model if isinstance(model, ModelSpec) else get_model_spec(model)
    device = resolve_device_type(device_type)
    if device == "cpu":
        raise CephaloError(
            "the `cpu` device has no catalog profile; measure it with `cephalo profile`"
        )
    timed = timed_model_for(spec)
    timing_meta: dict = {}
    try:
        if timed is None:
            raise LookupError
        entry, data_seq = _timing_entry(timed, device, seq_len, dtype)
        seq_scale = seq_len / data_seq
        block_fwd = _scaled(Curve.from_dict(entry["fwd_s"]), seq_scale)
        block_bwd = _scaled(Curve.from_dict(entry["bwd_s"]), seq_scale)
        timing_meta = {
            "data_key": entry["key"],
            "data_seq_len": data_seq,
            "timing_source": entry["source"],
        }
        if timed != spec.name:
            timing_meta["timing_model"] = timed
    except (LookupError, CephaloError):
        if timed == spec.name:
            raise  # a catalog model: say which of its profiles exist
        block_fwd, block_bwd, timing_meta = _estimated_block(spec, device, seq_len, dtype)
    uses_derived = timing_meta.get("timing_source") == "derived" or timing_meta.get(
        "estimated_from", ""
    ).endswith("(derived entries)")
    if device in DERIVED or uses_derived:
        timing_meta.update(derived_meta(device))
    act_block, act_source = block_activation_bytes_per_sample(spec, seq_len, dtype)
    emb_ratio, head_ratio = embedding_time_ratio(spec, seq_len), head_time_ratio(spec, seq_len)
    units = {
        "embedding": UnitProfile(
            _scaled(block_fwd, emb_ratio),
            _scaled(block_bwd, emb_ratio),
            _linear_bytes(boundary_activation_bytes(spec, seq_len, dtype)),
        ),
        "block": UnitProfile(block_fwd, block_bwd, _linear_bytes(act_block)),
        "head": UnitProfile(
            _scaled(block_fwd, head_ratio),
            _scaled(block_bwd, head_ratio),
            _linear_bytes(head_logits_bytes(spec, seq_len, dtype)),
        ),
    }
    return DeviceProfile(
        device_type=device,
        memory_bytes=device_memory_bytes(device),
        units=units,
        optimizer_s_per_param=optimizer_s_per_param(device),
        host_copy_bytes_per_s=host_copy_bytes_per_s(device),
        source="catalog",
        async_copies=True,  # every catalog device is a GPU: copies on a side stream
        meta={
            "model": spec.name,
            "seq_len": seq_len,
            "dtype": dtype,
            **timing_meta,
            "data_dtype": _data_dtype(dtype),  # bf16 reads the fp16 data
            "activation_source": act_source,
            "embedding_time_ratio": emb_ratio,
            "head_time_ratio": head_ratio,
        },
    )
