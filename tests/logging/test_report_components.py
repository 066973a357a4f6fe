"""The report plots every reward component's raw score, train and validation: from a real tiny run that trains on
JPEG compressibility + PickScore (a tiny random CLIP), and from a metrics file written the way the trainer names
components (`reward/<name>`, `val_reward/<name>_raw`, `reward_raw_mean`)."""

import json

import yaml
from PIL import Image

from gerl.logging.report import component_curves, load_run, write_report
from tests.logging.conftest import FAST
from tests.rewards.tiny_clip import save_tiny_clip
from tests.train.helpers import small_config


def _component_images(html: str) -> list[str]:
    return [part.split("'")[0] for part in html.split("<img src='")[1:] if "component_" in part.split("'")[0]]


def test_a_real_run_with_pickscore_logs_and_plots_its_raw_component(tmp_path):
    from gerl.trainer import train

    clip = save_tiny_clip(tmp_path / "clip")
    comps = [{"name": "jpeg_compressibility", "weight": 1.0, "normalize": "zscore"},
             {"name": "pickscore", "weight": 1.0, "kwargs": {"model": str(clip), "processor": ""}}]
    run = train(small_config(tmp_path / "run", "max_steps=2", "reward.name=", f"reward.components={json.dumps(comps)}",
                             *FAST))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward_mean" in r]
    assert train_rows and all(any(k.startswith("reward/pickscore") for k in r) for r in train_rows)
    curves = component_curves(load_run(run))
    assert {"pickscore", "jpeg_compressibility"} <= set(curves)
    assert len(curves["pickscore"]["train"][0]) == 2  # both steps
    # the raw PickScore of the tiny CLIP, not the z-scored or weighted value: |logit| ≤ exp(logit_scale) ≈ 14.3
    assert all(abs(v) <= 14.3 for v in curves["pickscore"]["train"][1])
    html = write_report([run]).read_text()
    pngs = _component_images(html)
    assert any("pickscore" in p for p in pngs) and any("jpeg_compressibility" in p for p in pngs)
    for p in pngs:
        with Image.open(run / p) as im:
            im.verify()


def test_components_are_read_under_both_metric_spellings(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    config = {"reward": {"components": [{"name": "ocr"}, {"name": "pickscore"}]}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    rows = [
        {"step": 1, "reward_mean": 0.1, "reward_raw_mean": 4.0, "reward/ocr_raw": 0.5, "reward/pickscore_raw": 20.0,
         "reward/pickscore/cosine": 0.2},
        {"step": 1, "val_reward_mean": 0.0, "val_reward_raw_mean": 4.5, "val_reward/ocr_raw": 0.6,
         "val_reward/pickscore_raw": 21.0, "val_num_prompts": 4},
        {"step": 2, "reward_mean": 0.2, "reward/ocr": 0.7, "reward/pickscore": float("nan"), "policy_version": 2},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    curves = component_curves(load_run(run))
    assert curves["ocr"] == {"train": ([1, 2], [0.5, 0.7]), "validation": ([1], [0.6])}
    assert curves["pickscore"] == {"train": ([1], [20.0]), "validation": ([1], [21.0])}  # NaN left out
    assert curves["total (raw)"] == {"train": ([1], [4.0]), "validation": ([1], [4.5])}
    assert curves["pickscore/cosine"] == {"train": ([1], [0.2])}
    assert "policy_version" not in curves and "num_prompts" not in curves
    html = write_report([run]).read_text()
    assert "Reward components (raw scores, train and validation)" in html
    assert len(_component_images(html)) == 4
