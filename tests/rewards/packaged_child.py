"""Run hpsv2 and ImageReward through gerl's rewards on tiny random weights, in the venv of
scripts/packaged_rewards_env.sh (test helper; tests/rewards/test_packaged_run.py starts it with the repo on
PYTHONPATH and HF_HUB_CACHE / HF_HUB_OFFLINE set). Prints one JSON object.

    python tests/rewards/packaged_child.py WORK_DIR HF_HUB_CACHE_DIR

Each model is built by the package's own code (hpsv2's OpenCLIP factory on a tiny config registered with its own
add_model_config; ImageReward's `RM.load` with a tiny BLIP text config), its checkpoint written to disk and loaded
back by gerl's reward, and every score compared with one computed through the package's own API on its own model.
ImageReward's vision tower is its fixed ViT-L/16 (24 layers, random init, ~1.2 GB): the package has no smaller one.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rewards.registry import build_reward, call_reward

TINY_HPS = {"embed_dim": 32, "quick_gelu": False,
            "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}}
BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "cube", "on", "table", "cat", "dog", "sign",
              "blue", "sky"] + list("abcdefghijklmnopqrstuvwxyz0123456789")


def images(n: int = 4) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)) for _ in range(n)]


def run_hpsv2(work: Path) -> dict:
    from hpsv2.src.open_clip import add_model_config, create_model_and_transforms, get_tokenizer

    config = work / "gerl-tiny-hps.json"
    config.write_text(json.dumps(TINY_HPS))
    add_model_config(config)
    torch.manual_seed(0)
    model, _, preprocess = create_model_and_transforms("gerl-tiny-hps", None, precision="fp32", device="cpu",
                                                       output_dict=True, light_augmentation=True)
    ckpt = work / "hps"
    ckpt.mkdir()
    torch.save({"state_dict": model.state_dict()}, ckpt / "HPS_v2.1_compressed.pt")

    prompts = ["a red cube", "a red cube", "a cat on a table", "a blue sky"]
    reward = build_reward("hpsv2", {"checkpoint": str(ckpt), "architecture": str(config), "device": "cpu",
                                    "dtype": "fp32"})
    reward.validate(prompts, [{}] * 4)
    t0 = time.perf_counter()
    scores, _ = call_reward(reward, images(), prompts, [{}] * 4)
    seconds = time.perf_counter() - t0
    one_by_one = build_reward("hpsv2", {"checkpoint": str(ckpt), "architecture": str(config), "device": "cpu",
                                        "dtype": "fp32", "batch_size": 1})
    single, _ = call_reward(one_by_one, images(), prompts, [{}] * 4)
    # the package's own API on the model it built: encode_image / encode_text with normalize=True
    model.eval()
    tok = get_tokenizer("gerl-tiny-hps")
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(im) for im in images()]), normalize=True)
        txt = model.encode_text(tok(prompts), normalize=True)
    expected = (img * txt).sum(-1).tolist()
    return {"scores": scores, "expected": expected, "batch_size_1": single, "seconds": seconds,
            "loaded_equal": all(torch.equal(a, b) for a, b in zip(reward.model()[0].state_dict().values(),
                                                                   model.state_dict().values()))}


def run_imagereward(work: Path, hub: Path) -> dict:
    from rewards.packaged import restore_moved_transformers_helpers

    restore_moved_transformers_helpers()  # importing ImageReward here, before the reward's _build does it
    from ImageReward.ImageReward import MLP

    snap = hub / "models--bert-base-uncased" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (hub / "models--bert-base-uncased" / "refs").mkdir()
    (hub / "models--bert-base-uncased" / "refs" / "main").write_text("0" * 40)
    (snap / "vocab.txt").write_text("\n".join(BERT_WORDS) + "\n")
    (snap / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 64}))
    (snap / "config.json").write_text(json.dumps({"model_type": "bert"}))
    med = work / "med_config.json"  # BLIP's text encoder, 1 layer; 768 wide because ImageReward's MLP(768) reads it
    med.write_text(json.dumps({
        "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 768, "num_hidden_layers": 1,
        "num_attention_heads": 12, "intermediate_size": 256, "vocab_size": len(BERT_WORDS) + 2,
        "max_position_embeddings": 64, "add_cross_attention": True, "encoder_width": 1024, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "layer_norm_eps": 1e-12,
        "type_vocab_size": 2, "pad_token_id": 0, "initializer_range": 0.02}))
    torch.manual_seed(1)
    # the package's MLP initialises weights ~N(0, 1/769): every image would score the same to 7 digits; a checkpoint
    # of unit-scale weights makes the score depend on the image and the prompt
    head = {f"mlp.{k}": torch.randn_like(v) * (0.2 if k.endswith("weight") else 0.0)
            for k, v in MLP(768).state_dict().items()}
    torch.save(head, work / "ImageReward.pt")

    prompts = ["a red cube", "a red cube", "a cat on a table"]
    torch.manual_seed(0)  # the BLIP towers the checkpoint leaves out are the package's own random init
    reward = build_reward("imagereward", {"model": str(work / "ImageReward.pt"), "med_config": str(med),
                                          "device": "cpu"})
    t0 = time.perf_counter()
    model = reward.model()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    scores, _ = call_reward(reward, images(3), prompts, [{}] * 3)
    seconds = time.perf_counter() - t0
    with torch.no_grad():  # the package's own single-image call, on the same model
        expected = [float(model.score(p, im)) for p, im in zip(prompts, images(3))]
    loaded = all(torch.equal(model.state_dict()[k], v) for k, v in head.items())
    return {"scores": scores, "expected": expected, "seconds": seconds, "load_s": load_s, "loaded_equal": loaded}


def main() -> None:
    from gerl import torchvision_ops

    torchvision_ops.install()  # this script imports the packages itself, before the rewards' own _build arms it
    work = Path(sys.argv[1])
    out = {"hpsv2": run_hpsv2(work), "imagereward": run_imagereward(work, Path(sys.argv[2]))}
    import torchvision

    out["torchvision"] = {"version": torchvision.__version__, "schemas_declared": torchvision_ops.declared,
                          "has_compiled_ops": torchvision.extension._has_ops()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
