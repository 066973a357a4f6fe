"""`gerl report` on real tiny CPU runs: files, local-only references, valid PNGs, the seed table, errors, CLI."""

from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from gerl.cli import main
from gerl.errors import UserError
from gerl.logging.report import SEED_COLUMNS, Run, seed_row, write_report


class Page(HTMLParser):
    """Collects every src/href attribute and the cells of each table."""

    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        self.links += [v for k, v in attrs if k in ("src", "href") and v is not None]
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text())
    return page


def test_report_of_two_runs_is_local_valid_and_matches_configs(report_runs, tmp_path):
    (tmp_path / "cmp").mkdir()
    out = write_report(report_runs, tmp_path / "cmp")  # an existing directory gets report.html inside it
    assert out == tmp_path / "cmp" / "report.html" and out.is_file()
    text = out.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text
    page = parse(out)
    assert len(page.links) >= 3 + 2 * len(report_runs)  # 3 curves + samples and timeline per run
    for link in page.links:
        assert not link.startswith(("/", "//")) and ":" not in link, link  # relative, no scheme, no absolute path
        target = out.parent / link
        assert target.is_file(), link
    pngs = sorted((out.parent / "report_files").glob("*.png"))
    assert {p.name for p in pngs} >= {"val_reward_vs_step.png", "val_reward_vs_gpu_hours.png", "train_reward.png"}
    for p in pngs:
        with Image.open(p) as im:
            im.verify()
            assert im.format == "PNG"

    # Flow-GRPO with train.beta 0: the clip fraction and the gradient norm apply, a KL curve would be zeros
    names = {p.name for p in pngs}
    assert "clipfrac_grad_norm.png" in names and "kl_clipfrac_grad_norm.png" not in names
    header, *rows = page.tables[0]
    # these are CPU runs: the hours column counts core-hours, and says so
    assert header == [("# Core Hour" if c == "# GPU Hour" else c) for c in SEED_COLUMNS]
    by_run = {r[0]: dict(zip(SEED_COLUMNS, r)) for r in rows}
    assert set(by_run) == {"lr_a", "lr_b"}
    assert by_run["lr_a"]["Learning Rate"] == "0.01" and by_run["lr_b"]["Learning Rate"] == "0.003"
    for r in by_run.values():
        assert r["Algorithm"] == "Flow-GRPO-Fast" and r["Loss"] == "ppo_clip (ε 0.01)"
        assert r["Batch Size"] == "4 (2×2)" and r["rollout.n"] == "2" and r["# Val Samples"] == "4"
        assert r["Reward Fn"] == "jpeg_compressibility" and r["# Cards"] == "1"
        assert r["Hybrid Engine"] == "yes (local)" and r["Async Strategy"] == "with_reward"
        assert float(r["Throughput (images/s/GPU)"]) > 0
        assert "not reached" in r["# GPU Hour"]  # the JPEG reward is negative; the default target is 0.8
        assert r["# GPU Hour"].endswith("core-hours")
    # final and best validation reward, each with its step, match metrics.jsonl
    import json

    rows_a = [json.loads(x) for x in (report_runs[0] / "metrics.jsonl").read_text().splitlines()]
    vals = [(x["step"], x["val_reward_mean"]) for x in rows_a if x.get("val_reward_mean") is not None]
    best = max(vals, key=lambda v: v[1])
    assert by_run["lr_a"]["Final Val Reward"] == f"{vals[-1][1]:.4g} (step {vals[-1][0]})"
    assert by_run["lr_a"]["Best Val Reward"] == f"{best[1]:.4g} (step {best[0]})"


def test_cli_report_one_run_default_path_and_errors(report_runs, capsys):
    run = report_runs[0]
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").is_file() and (run / "report_files" / "train_reward.png").is_file()
    assert main(["report", *map(str, report_runs)]) == 2  # several runs need --out
    assert "--out" in capsys.readouterr().err


def test_bad_run_directories_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist") as e:
        write_report([tmp_path / "nope"])
    assert str(tmp_path / "nope") in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no metrics.jsonl"):
        write_report([tmp_path / "empty"])
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="empty"):
        write_report([tmp_path / "empty"])
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match="line 2"):
        write_report([tmp_path / "empty"])


def fake_run(config: dict, rows: list[dict]) -> Run:
    return Run(Path("/runs/x"), "x", config, rows, [])


def test_seed_row_reads_engine_and_schedule_and_counts_hours_to_target():
    rows = [{"step": 0, "validate_s": 360.0, "val_reward_mean": 0.1},
            {"step": 1, "images": 64, "step_s": 3600.0, "validate_s": 0.0, "val_reward_mean": 0.9}]
    cfg = {"model": {"path": "stabilityai/stable-diffusion-3.5-medium"}, "sampling": {"sde_window_size": 0},
           "data": {"prompts_per_step": 8, "group_size": 8}, "train": {"learning_rate": 1e-4},
           "reward": {"name": "ocr", "with_reward": True}, "validation": {"every": 20, "num_prompts": 32},
           "engine": {"kind": "ray", "hybrid": False, "actor_workers": 1, "rollout_workers": 2, "schedule": "async",
                      "max_staleness": 1}, "metrics": {"target_val_reward": 0.8, "target_hold": 1}}
    r = seed_row(fake_run(cfg, rows))
    assert r["Model"] == "SD3.5-M" and r["Algorithm"] == "Flow-GRPO"
    assert r["Hybrid Engine"] == "no" and r["# Cards"] == "3" and r["# GPUs actor / rollout"] == "1 / 2"
    assert r["Async Strategy"] == "with_reward + one-step-off"
    assert r["Batch Size"] == "64 (8×8)" and r["Learning Rate"] == "0.0001" and r["# Val Samples"] == "32"
    assert r["Throughput (images/s/GPU)"] == f"{64 / (3600 * 3):.3g}"
    assert r["# GPU Hour"].startswith("3.3 (to val ≥ 0.8)")  # 3 devices × (0.1 h + 1 h)
    cfg["engine"].update(max_staleness=3)
    cfg["reward"]["with_reward"] = False
    assert seed_row(fake_run(cfg, rows))["Async Strategy"] == "3-stale"
    cfg["engine"].update(schedule="sync", hybrid=True, actor_workers=2, rollout_workers=2)
    r = seed_row(fake_run(cfg, rows))
    assert r["Async Strategy"] == "sync" and r["Hybrid Engine"] == "yes" and r["# Cards"] == "2"
    logged = [dict(x, devices=4) for x in rows]  # a logged device count wins over the config
    assert seed_row(fake_run(cfg, logged))["# Cards"] == "4"
    shared = [dict(x, devices=1.0) for x in rows]  # 1 actor + 1 rollout host at engine.gpus_per_worker=0.5: one GPU
    r = seed_row(fake_run(cfg, shared))
    assert r["# Cards"] == "1" and r["Throughput (images/s/GPU)"] == f"{64 / 3600:.3g}"
    assert r["# GPU Hour"].startswith("1.1 (to val ≥ 0.8)")  # 1 GPU × (0.1 h + 1 h)


def test_validation_grids_have_caption_sidecars_in_tile_order(report_runs):
    import json

    from gerl.logging.report import _captions

    run = report_runs[0]
    side = json.loads((run / "samples" / "val_step_000003.json").read_text())
    assert len(side["prompts"]) == len(side["scores"]) == 4  # validation.num_prompts
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    finite = [s for s in side["scores"] if s is not None]
    assert finite and abs(sum(finite) / len(finite) - rows[-1]["val_reward_mean"]) < 1e-4
    caps = _captions(run / "samples" / "val_step_000003.png".replace(".png", ".json"), 2)
    assert caps[0] == f"score {side['scores'][0]:.3g}\n{side['prompts'][0]}"
    assert _captions(run / "samples" / "missing.json", 2) == []  # an older run without sidecars: no captions


def test_sample_matrix_draws_captions_under_the_tiles(tmp_path):
    from gerl.logging import plots

    tiles = [Image.new("RGB", (16, 16), "white") for _ in range(2)]
    plain = plots.sample_matrix([(1, tiles, [])], tmp_path / "plain.png", "t", tile=64)
    captioned = plots.sample_matrix([(1, tiles, ["score 0.5\na long prompt " * 3] * 2)], tmp_path / "cap.png", "t",
                                    tile=64)
    with Image.open(plain) as a, Image.open(captioned) as b:
        assert b.height > a.height and a.width == b.width
        # the caption band under the first tile holds dark (text) pixels
        band = b.convert("L").crop((70, 40 + 64, 70 + 64, 40 + 64 + 26))
        assert min(band.getdata()) < 128


def test_hours_are_core_hours_on_cpu_and_gpu_hours_otherwise():
    rows = [{"step": 1, "images": 4, "step_s": 3600.0, "devices": 1, "device_type": "cpu", "cores_per_device": 2,
             "val_reward_mean": 0.1}]
    cpu = seed_row(fake_run({}, rows))
    assert cpu["# GPU Hour"] == "2 total (target 0.8 not reached) core-hours"  # 1 device × 2 cores × 1 h
    gpu = seed_row(fake_run({}, [dict(rows[0], device_type="cuda")]))
    assert gpu["# GPU Hour"] == "1 total (target 0.8 not reached)"
    assert cpu["Final Val Reward"] == cpu["Best Val Reward"] == "0.1 (step 1)"
    assert seed_row(fake_run({}, [{"step": 1}]))["Final Val Reward"] == "–"
