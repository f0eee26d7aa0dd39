"""Which charts the report draws, grouped into sections, and which logged metrics each one takes.

A panel names metrics by glob patterns (``val-core/*``). Kinds:

- ``line``: one line per metric.
- ``band``: a metric family logged as ``<base>/mean``, ``/min``, ``/max``: the mean as a line
  over a shaded min-max band (how a step's values were spread).
- ``stack``: stacked bars, one per metric (the step's time by phase).

``absolute``: draw |value| (a signed estimate such as the mismatch KL on a log axis).
``log_y``: True draws a log axis (values that span decades: the rollout/trainer mismatch);
None picks one when the positive values span at least :data:`LOG_SPAN` (two decades).
A panel whose metrics a run did not log is left out; metrics no panel claims are drawn in an
"Other metrics" section, grouped by name prefix, so nothing logged goes unseen.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

LOG_SPAN = 100.0


@dataclass(frozen=True)
class Panel:
    """One chart (see the module docstring)."""

    title: str
    patterns: tuple[str, ...]
    kind: str = "line"
    log_y: bool | None = None
    smooth: bool = True
    absolute: bool = False
    note: str = ""
    exclude: tuple[str, ...] = ()

    def claims(self, name: str) -> bool:
        """Whether the metric ``name`` is drawn by this panel."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
            return False
        if self.kind == "band":
            return any(name in (f"{p}/mean", f"{p}/min", f"{p}/max") for p in self.patterns)
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def metrics(self, names: set[str]) -> list[str]:
        """The metrics among ``names`` this panel draws (for a band: the family bases), sorted."""
        if self.kind == "band":
            return [p for p in self.patterns if f"{p}/mean" in names]
        return sorted(n for n in names if self.claims(n))


SECTIONS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Preference optimization",
        (
            Panel("Loss (train, and validation pairs)", ("loss", "eval_loss", "nll_loss", "eval_nll_loss")),
            Panel(
                "Preference accuracy: chosen reward > rejected reward",
                ("rewards/accuracies", "eval_rewards/accuracies"),
            ),
            Panel("Reward margin (chosen − rejected)", ("rewards/margins", "eval_rewards/margins")),
            Panel(
                "Implicit rewards β·log(π/π_ref)",
                ("rewards/chosen", "rewards/rejected", "eval_rewards/chosen", "eval_rewards/rejected"),
            ),
            Panel("Summed response log-probs", ("logps/*", "eval_logps/*")),
            Panel("Gradient norm", ("grad_norm",)),
            Panel("Learning rate", ("learning_rate",), smooth=False),
        ),
    ),
    (
        "Reward",
        (
            Panel("Training score per response (mean, min–max band)", ("critic/score",), "band"),
            Panel("Reward after penalties (mean, min–max band)", ("critic/rewards",), "band"),
            Panel("Advantages (mean, min–max band)", ("critic/advantages",), "band", smooth=False),
            Panel("Reward diagnostics", ("reward/*", "dynamic_sampling/*"), smooth=False),
        ),
    ),
    (
        "Validation",
        (
            Panel("Validation accuracy per data source", ("val-core/*",), smooth=False),
            Panel("Validation score per data source", ("val-aux/*/score/*",), smooth=False),
            Panel("Validation response length", ("val-aux/response_length/*",), smooth=False),
        ),
    ),
    (
        "Responses",
        (
            Panel("Response length in tokens (mean, min–max band)", ("response_length",), "band"),
            Panel("Responses cut at the length limit (clip ratio)", ("response_length/clip_ratio",)),
            Panel("Prompt length in tokens (mean, min–max band)", ("prompt_length",), "band", smooth=False),
        ),
    ),
    (
        "Policy update",
        (
            Panel("Entropy", ("actor/entropy",)),
            Panel("Policy loss", ("actor/pg_loss",)),
            Panel("Clip fraction", ("actor/pg_clipfrac*",)),
            Panel(
                "KL: policy vs old policy, and the KL loss to the reference", ("actor/ppo_kl", "actor/kl_*")
            ),
            Panel("Gradient norm", ("actor/grad_norm",)),
            Panel("Learning rate", ("actor/lr",), smooth=False),
            Panel("Largest |weight|", ("actor/max_abs_weight",), smooth=False),
            Panel("Skipped updates (non-finite loss or gradients)", ("actor/skipped_*",), smooth=False),
        ),
    ),
    (
        "Rollout vs trainer",
        (
            Panel(
                "Mismatch KL between rollout and trainer log-probs",
                ("rollout_corr/kl", "rollout_corr/k3_kl"),
                log_y=True,
                smooth=False,
                absolute=True,
                note="|value| on a log axis; steps with exactly 0 (bit-identical log-probs) are not drawn on it",
            ),
            Panel(
                "max |Δ log p| over response tokens",
                ("rollout_corr/max_abs_log_prob_diff",),
                log_y=True,
                smooth=False,
                note="log axis; steps with exactly 0 are not drawn on it",
            ),
            Panel("Importance weights and masking", ("rollout_corr/*",), smooth=False),
        ),
    ),
    (
        "Time and throughput",
        (
            Panel(
                "Seconds per step by phase",
                ("timing_s/*",),
                "stack",
                log_y=False,
                smooth=False,
                exclude=("timing_s/step",),
                note="bars stack the phases; the line is the whole step (the gap is bookkeeping)",
            ),
            Panel("Throughput (tokens per second per worker)", ("perf/throughput",)),
            Panel("Tokens per step", ("perf/total_num_tokens",)),
            Panel("Peak GPU memory per phase (GB)", ("perf/max_memory*",), smooth=False),
        ),
    ),
    (
        "Pipeline",
        (
            Panel(
                "Staleness of trained samples (weight versions behind)",
                ("pipeline/staleness/*",),
                smooth=False,
            ),
            Panel("Sample queue depth (prompt groups)", ("pipeline/queue_depth",), smooth=False),
            Panel("Idle time per step (s)", ("pipeline/*idle_s",), smooth=False),
            Panel("Weight sync time (s)", ("pipeline/weight_sync_s",), smooth=False),
            Panel("Weight sync bandwidth (GB/s)", ("pipeline/weight_sync_gbps",), smooth=False),
            Panel(
                "Partial and dropped samples",
                ("pipeline/partial_samples", "pipeline/dropped_stale"),
                smooth=False,
            ),
            Panel("Rollout weight version", ("pipeline/rollout_version",), smooth=False),
        ),
    ),
)

STEP_TIME = "timing_s/step"
NEVER_DRAWN = frozenset({"training/epoch", "epoch"})


def plan(names: set[str]) -> list[tuple[str, list[tuple[Panel, list[str]]]]]:
    """The sections and panels to draw for the logged metric ``names``: each metric goes to the
    first panel that claims it; panels left empty are dropped; the rest go to "Other metrics",
    one panel per name prefix (``a/b/c`` -> ``a/b``).

    Returns ``[(section title, [(panel, its metrics — family bases for a band), ...]), ...]``.
    """
    taken = set(NEVER_DRAWN) | {STEP_TIME}
    sections = []
    for title, panels in SECTIONS:
        drawn = []
        for panel in panels:
            metrics = [m for m in panel.metrics(names - taken)]
            if not metrics:
                continue
            drawn.append((panel, metrics))
            for metric in metrics:
                taken |= (
                    {metric, f"{metric}/mean", f"{metric}/min", f"{metric}/max"}
                    if panel.kind == "band"
                    else {metric}
                )
        if drawn:
            sections.append((title, drawn))
    groups: dict[str, list[str]] = {}
    for name in sorted(names - taken):
        prefix = "/".join(name.split("/")[:2]) if name.count("/") >= 2 else name.split("/")[0]
        groups.setdefault(prefix, []).append(name)
    if groups:
        sections.append(
            (
                "Other metrics",
                [
                    (Panel(prefix, tuple(members), smooth=False), members)
                    for prefix, members in groups.items()
                ],
            )
        )
    return sections
