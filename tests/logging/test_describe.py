"""What the report says a run trained — algorithm, loss, schedule, the curves that apply — read from the run's
config.yaml, here the exact tree `gerl train` writes for each shipped recipe (load_config → to_yaml), with the
expected labels worked out by hand from the recipes' YAML."""

import json
import shlex
from pathlib import Path

import pytest
import yaml

from gerl.config import load_config, to_yaml
from gerl.logging import describe, report

REPO = Path(__file__).resolve().parents[2]


def written_config(recipe: str, *overrides: str) -> dict:
    """config.yaml as `gerl train RECIPE OVERRIDES...` writes it into the run directory."""
    return yaml.safe_load(to_yaml(load_config(str(REPO / "recipes" / recipe), list(overrides))))


def quickstart_command() -> tuple[str, list[str]]:
    """The recipe and overrides of scripts/quickstart.sh's own `gerl train` line (its output directory left out)."""
    text = (REPO / "scripts" / "quickstart.sh").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("gerl train "))
    words = [w for w in shlex.split(line)[2:] if w != "$@"]
    return Path(words[0]).name, [w for w in words[1:] if not w.startswith(("output_dir=", "overwrite="))]


def labels(cfg: dict) -> tuple[str, str, str, list[str]]:
    return describe.algorithm(cfg), describe.loss(cfg), describe.schedule(cfg), describe.curves_that_apply(cfg)


def test_the_quickstart_run_is_awm_one_step_off():
    recipe, overrides = quickstart_command()
    assert recipe == "ocr_mini_awm.yaml" and "engine.schedule=async" in overrides
    cfg = written_config(recipe, *overrides)
    # ocr_mini_awm.yaml: clip_range 1.0, awm_weighting ghuber, beta 0.003, anchor_beta 1.0; the quickstart's
    # engine.schedule=async with max_staleness=1 and reward.with_reward's default (true)
    assert labels(cfg) == ("AWM", "awm clipped ratio (ε 1, ghuber weighting) + KL β 0.003 + anchor β 1",
                           "with_reward + one-step-off",
                           # 8 × 8 images in mini-batches of 32: two optimizer steps, so the second can clip
                           ["kl", "clipfrac", "grad_norm"])


@pytest.mark.parametrize("recipe, overrides, want", [
    # window 3 of ocr_mini.yaml; its clip_range 1e-2; beta 0 (the default): no KL curve
    ("ocr_mini.yaml", [], ("Flow-GRPO-Fast", "ppo_clip (ε 0.01)", "with_reward", ["clipfrac", "grad_norm"])),
    ("ocr_mini.yaml", ["sampling.sde_window_size=0", "reward.with_reward=false"],
     ("Flow-GRPO", "ppo_clip (ε 0.01)", "sync", ["clipfrac", "grad_norm"])),
    # nft: nft_beta 1.0, train.beta 1e-4; no ratio, so no clip fraction
    ("ocr_mini_nft.yaml", [], ("DiffusionNFT", "nft ± velocities (β 1) + KL β 0.0001", "with_reward",
                               ["kl", "grad_norm"])),
    # the reference AWM recipe: mini_batch_size 1728 = 72 prompts × 24 images, one optimizer step per update, so
    # the ratio is 1 by construction and its clip fraction is left out
    ("awm_sd3_ocr.yaml", ["reward.with_reward=false"],
     ("AWM", "awm clipped ratio (ε 1, ghuber weighting) + KL β 0.003 + anchor β 1", "sync", ["kl", "grad_norm"])),
    # dgpo: β 2000 against the anchor, clip 1e-5, KL 0.001; one optimizer step per update, but the anchor lags (rate
    # 0.001, max 0.3), so its ratio to the anchor can clip
    ("ocr_mini_dgpo.yaml", [], ("DGPO", "dgpo group preference (β 2000, vs the anchor, clip ε 1e-05) + KL β 0.001",
                                "with_reward", ["kl", "clipfrac", "grad_norm"])),
    # its own SD3.5 recipe with a still anchor: the ratio is 1 at its one optimizer step, no clip fraction
    ("dgpo_sd3_ocr.yaml", ["algo.anchor_decay_rate=0", "reward.with_reward=false"],
     ("DGPO", "dgpo group preference (β 100, vs the base, clip ε 0.01) + KL β 0.02", "sync", ["kl", "grad_norm"])),
])
def test_each_algorithm_from_its_recipe(recipe, overrides, want):
    assert labels(written_config(recipe, *overrides)) == want


RAY = ["engine.kind=ray", "engine.hybrid=false", "engine.device=cpu", "engine.cpus_per_worker=1"]


@pytest.mark.parametrize("overrides, schedule", [
    ([*RAY, "engine.schedule=async", "engine.max_staleness=1"], "with_reward + one-step-off"),
    ([*RAY, "engine.schedule=async", "engine.max_staleness=3", "reward.with_reward=false"], "3-stale"),
    ([*RAY, "engine.schedule=stream", "engine.max_staleness=2"], "with_reward + stream (≤ 2 stale, drop)"),
    ([*RAY, "engine.schedule=stream", "engine.max_staleness=2", "engine.stale=downweight", "engine.stale_decay=0.25"],
     "with_reward + stream (≤ 2 stale, downweight ×0.25)"),
    ([*RAY[:1], "engine.device=cpu", "engine.cpus_per_worker=1"], "with_reward"),  # hybrid Ray: sync
])
def test_each_schedule(overrides, schedule):
    assert describe.schedule(written_config("ocr_mini.yaml", *overrides)) == schedule


@pytest.mark.parametrize("overrides, loss", [
    (["engine.ratio_cap=3"], "ppo_clip (ε 0.01, dual clip at 3)"),
    (["train.loss=tis", "train.is_cap=2"], "tis (weight cap 2)"),
    (["train.loss=topr", "train.topr_split=reward"], "topr (negatives by reward)"),
    (["train.loss=cispo"], "cispo (weight in [1 − 0.01, 1 + 0.01])"),  # 0 = train.clip_range for each side
    (["train.loss=cispo", "train.cispo_eps_low=0.2", "train.beta=0.04"],
     "cispo (weight in [1 − 0.2, 1 + 0.01]) + KL β 0.04"),
])
def test_each_flow_grpo_loss(overrides, loss):
    assert describe.loss(written_config("ocr_mini.yaml", *overrides)) == loss


def test_a_key_the_run_predates_reads_as_the_typed_default():
    cfg = written_config("ocr_mini.yaml")
    del cfg["algo"], cfg["train"]["loss"]  # a run from before gerl had algorithms and losses: Flow-GRPO's
    assert labels(cfg)[:2] == ("Flow-GRPO-Fast", "ppo_clip (ε 0.01)")
    assert describe.curves_that_apply({}) == ["kl", "clipfrac", "grad_norm"]  # no config.yaml: all, as logged


def _fake_run(path: Path, cfg: dict, stats: dict) -> Path:
    """A run directory with this config.yaml and three CPU training steps logging `stats` (no samples, no timeline)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": s, "images": 64, "step_s": 10.0, "reward_mean": 0.1 * s, "reward_std": 0.05,
             "device_type": "cpu", "cores_per_device": 1, **{k: v * s for k, v in stats.items()}} for s in (1, 2, 3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_report_of_the_quickstart_and_an_nft_run(tmp_path, monkeypatch):
    """The seed table names each run's algorithm, loss and schedule; a curve is drawn only for the runs it applies
    to, and a panel that applies to none is left out."""
    recipe, overrides = quickstart_command()
    awm = _fake_run(tmp_path / "quickstart", written_config(recipe, *overrides),
                    {"kl": 1e-3, "clipfrac": 0.0, "grad_norm": 0.5})
    # NFT logs no clip fraction; beta 0 here: its kl key would be a line of zeros
    nft = _fake_run(tmp_path / "nft", written_config("ocr_mini_nft.yaml", "train.beta=0"),
                    {"kl": 0.0, "grad_norm": 0.2})
    drawn = {}
    real = report.plots.panel_plot

    def panel_plot(panels, path, xlabel):
        drawn[path.name] = {title: sorted(series) for title, series in panels.items()}
        return real(panels, path, xlabel)

    monkeypatch.setattr(report.plots, "panel_plot", panel_plot)
    out = report.write_report([awm, nft], tmp_path / "both.html")
    assert drawn == {"kl_clipfrac_grad_norm.png": {"KL to the reference": ["quickstart"],
                                                   "clip fraction": ["quickstart"],
                                                   "gradient norm (pre-clip)": ["nft", "quickstart"]}}
    text = out.read_text()
    table = text[text.index("<table>"):text.index("</table>")]
    assert "<td>AWM</td><td>awm clipped ratio (ε 1, ghuber weighting) + KL β 0.003 + anchor β 1</td>" in table
    assert "<td>with_reward + one-step-off</td>" in table and "<td>DiffusionNFT</td>" in table
    assert "Flow-GRPO" not in text
    assert "No run logged a validation reward" in text and "val_reward_vs_step.png" not in text

    drawn.clear()
    report.write_report([nft], tmp_path / "nft.html")
    assert drawn == {"grad_norm.png": {"gradient norm (pre-clip)": ["nft"]}}
