"""The readable table `gerl plan` prints (`--json` prints MemoryPlan.to_dict() instead)."""

from __future__ import annotations

from gerl.plan.fit import Change, Fit
from gerl.plan.planner import MemoryPlan, RolePlan

W = 74  # width of the name column


def _short(knob: str) -> str:
    """ "train.micro_batch_size (gradient checkpointing on)" → "train mb (ckpt on)" for column headers."""
    return (knob.replace(".micro_batch_size", " mb").replace("sampling", "sample")
            .replace("gradient checkpointing ", "ckpt "))


def format_role(r: RolePlan, checkpointing: bool, unit: str = "GiB") -> list[str]:
    k = 1024 if unit == "MiB" else 1  # a tiny model reads better in MiB
    lines = [f"{r.role}".ljust(W) + f"{unit:>9}"]
    for i in r.resident:
        lines.append(f"  {i.name}".ljust(W - 16) + f"{i.detail:>16}" + f"{i.gib * k:9.2f}")
    lines.append("  resident".ljust(W) + f"{r.resident_gib * k:9.2f}")
    lines.append(f"  transient peak of each phase (at the configured micro-batch, + {unit} per sample):")
    top = r.peak_phase
    for p in r.phases:
        mark = "*" if p is top else " "
        at = f"{p.knob.split('.')[0]} mb {p.batch}" if p.knob else ""
        tail = f"  (+{p.per_sample_gib * k:.3f}/sample)" if p.knob else ""
        tail += "" if p.in_peak else "  not this config's"
        lines.append(f"  {mark} {p.name}".ljust(W - 15) + f"{at:>15}" + f"{p.gib * k:9.2f}" + tail)
    lines.append(f"  peak = resident + {top.name if top else 'nothing'}".ljust(W) + f"{r.peak_gib * k:9.2f}")
    if any(p.checkpointing is not None for p in r.phases):
        other = not checkpointing
        lines.append(f"  (with gradient checkpointing {'on' if other else 'off'}: "
                     f"{r.peak_gib_with(checkpointing=other) * k:.2f} {unit})")
    knobs = list(r.cards[0].max_micro_batch) if r.cards else []
    head = f"  {'card':<8}{'GiB':>7}  {'fits':<5}{'headroom':>9}" + "".join(f"{'max ' + _short(n):>26}" for n in knobs)
    lines += ["", head]
    for c in r.cards:
        lines.append(f"  {c.card:<8}{c.capacity_gib:7.1f}  {'yes' if c.fits else 'NO':<5}{c.headroom_gib:9.2f}"
                     + "".join(f"{c.max_micro_batch[n] or '-':>26}" for n in knobs))
    return lines


def format_fit(fit: Fit) -> list[str]:
    """The target card's verdict and, when it does not fit, the changes that do, the smallest first."""
    card = f"{fit.card} card ({fit.capacity_gib:g} GiB)"
    if fit.fits:
        return [f"fits one {card} as configured"]
    if not fit.changes:
        return [f"does not fit one {card}, and nothing gerl plan tries does: " + "; ".join(fit.tried)
                + " (a larger card: the table above)"]
    def line(c: Change) -> str:
        peaks = ", ".join(f"{r} {p:.2f} GiB" for r, p in c.peaks.items())
        return f"{' '.join(c.overrides)}  ({peaks}; headroom {c.headroom_gib:.2f})"
    out = [f"does not fit one {card}; the smallest change that fits:", f"  {line(fit.changes[0])}"]
    if len(fit.changes) > 1:
        out.append("other changes that fit, in the order tried (docs/plan.md, 'The smallest change that fits'):")
        out += [f"  {line(c)}" for c in fit.changes[1:]]
    return out


def format_plan(plan: MemoryPlan) -> str:
    """The plan as text: a header, then per role its resident lines, phases, peak and card verdicts."""
    out = [f"gerl plan: {plan.model} ({plan.source})",
           f"  {plan.dtype}, {plan.resolution} px → latent {'×'.join(map(str, plan.latent))}, {plan.inputs}; "
           f"{plan.placement}"]
    if plan.training_forwards:
        old = {None: "", True: " (awm: the policy moves within an update, so old log-probs need their own forward)",
               False: " (awm: one optimizer step per update, so the training forward gives the old log-probs)"}
        out.append(f"  algo.name={plan.algo}: transformer forwards per trained point: "
                   f"{' + '.join(plan.training_forwards)}{old[plan.awm_old_forward]}")
    out.append("")
    unit = "GiB" if max(r.peak_gib for r in plan.roles) >= 1 else "MiB"
    for r in plan.roles:
        out += format_role(r, plan.gradient_checkpointing, unit) + [""]
    out.append("headroom: GiB left on the card after the margin; max mb: the largest micro-batch that fits with the "
               "other micro-batches as configured (- = none)")
    if plan.fit is not None:
        out += format_fit(plan.fit)
    out += [f"note: {n}" for n in plan.notes]
    out.append(f"planned in {plan.elapsed_s:.1f} s on fake tensors (docs/plan.md: what is counted and how)")
    return "\n".join(out) + "\n"
