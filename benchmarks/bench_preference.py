"""CPU cost of the CLIP preference rewards at real size, next to the OCR reward, measured side by side in one run.

    python -m benchmarks preference [--images 16] [--batch 8]

`clipscore` and `aesthetic` run OpenAI CLIP ViT-L/14's architecture (random weights: no download; speed does not
depend on the weights) with the real 224 px image processor; `ocr` is rapidocr on the same 512 px images. Each
reward scores one micro-batch to load its model, then all images timed, micro-batch by micro-batch, through a
thread pool of one.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from gerl.logging.quiet import quiet_libraries  # noqa: E402
from gerl.config import RewardComponent  # noqa: E402
from gerl.workers.reward import RewardSet  # noqa: E402
from rewards.registry import build_reward  # noqa: E402


def save_clip_l14(path: Path) -> None:
    """ViT-L/14 CLIP (428 M parameters) with random weights, and a 224 px processor with gerl's tiny tokenizer."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    from gerl.models.tiny import build_clip_tokenizer

    tok = build_clip_tokenizer()
    tok.model_max_length = 77
    text = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                max_position_embeddings=77, vocab_size=49408, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=224, patch_size=14)
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=768)).save_pretrained(str(path))
    CLIPProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tok).save_pretrained(str(path))
    from tests.rewards.tiny_clip import save_aesthetic_head

    save_aesthetic_head(path / "aesthetic-model.pth", in_dim=768)


def images(n: int, size: int = 512) -> tuple[list, list]:
    font = ImageFont.load_default(size=size // 8)
    imgs, prompts = [], []
    for i in range(n):
        im = Image.new("RGB", (size, size), "white")  # rendered text: what the OCR recipes generate
        ImageDraw.Draw(im).text((size // 10, size // 3), f"GERL{i % 8}", fill="black", font=font)
        imgs.append(im)
        prompts.append(f'a sign that says "GERL{i % 8}"')  # 8 distinct prompts, as a GRPO batch of 8-image groups
    return imgs, prompts


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="images per micro-batch (and per forward pass)")
    args = ap.parse_args()
    quiet_libraries()
    imgs, prompts = images(args.images)
    mb = args.batch
    with tempfile.TemporaryDirectory() as tmp:
        clip = Path(tmp) / "clip-l14"
        save_clip_l14(clip)
        rewards = {
            "ocr": ("ocr", {}),
            "clipscore": ("clipscore", {"model": str(clip), "batch_size": mb}),
            "aesthetic": ("aesthetic", {"model": str(clip), "head": str(clip), "batch_size": mb}),
        }
        print(f"{args.images} images of 512 px in micro-batches of {mb}, thread pool x1, CPU")
        print(f"{'reward':>10}{'load s':>9}{'images/s':>10}{'ms/image':>10}")
        rates = {}
        for name, (reg, kwargs) in rewards.items():
            rs = RewardSet([RewardComponent(name=reg, pool="thread", workers=1)], [build_reward(reg, kwargs)],
                           600.0, 0, 0.0)
            t0 = time.perf_counter()
            rs.gather([rs.submit(imgs[:mb], prompts[:mb], [{}] * mb)])  # loads the model
            load = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = rs.gather([rs.submit(imgs[i:i + mb], prompts[i:i + mb], [{}] * mb)
                             for i in range(0, args.images, mb)])
            dt = time.perf_counter() - t0
            rs.close()
            assert not res.failed.any(), name
            rates[name] = args.images / dt
            print(f"{name:>10}{load:>9.1f}{rates[name]:>10.2f}{1000 * dt / args.images:>10.0f}")
        print("ratios (images/s): " + ", ".join(f"{n} / ocr = {rates[n] / rates['ocr']:.2f}"
                                                for n in ("clipscore", "aesthetic")))


if __name__ == "__main__":
    main()
