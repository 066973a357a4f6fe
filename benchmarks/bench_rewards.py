"""Reward-library benchmarks, each measured side by side in one run:

  ocr      OCR images/s by backend and pool (thread/process × 1/2 workers) at 64/128/512 px, on real rendered text
  vlm      VLM requests/s with 1/4/16 in flight against a real `transformers serve` (tiny random LLaVA, CPU)
  overlap  with_reward step time vs its ideal, for a reward whose latency equals one micro-batch's generation time

    python -m benchmarks rewards [ocr,vlm,overlap]
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for the tests/ helpers that build the VLM server

from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from gerl.logging.quiet import quiet_libraries  # noqa: E402
from gerl.config import RewardComponent  # noqa: E402
from gerl.workers.reward import RewardSet  # noqa: E402
from rewards.registry import build_reward  # noqa: E402


def text_images(n: int, size: int) -> tuple[list, list]:
    font = ImageFont.load_default(size=max(8, size // 6))
    imgs, prompts = [], []
    for i in range(n):
        word = f"GERL{i % 10}"
        im = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(im).text((size // 10, size // 3), word, fill="black", font=font)
        imgs.append(im)
        prompts.append(f'a sign that says "{word}"')
    return imgs, prompts


def bench_ocr() -> None:
    print("OCR (rapidocr, PP-OCR ONNX) images/s — 32 images submitted as 4 micro-batches of 8")
    print(f"{'px':>5}{'thread x1':>11}{'thread x2':>11}{'process x1':>12}{'process x2':>12}{'mean score':>12}")
    for size in (64, 128, 512):
        imgs, prompts = text_images(32, size)
        row, score = [], 0.0
        for pool, workers in (("thread", 1), ("thread", 2), ("process", 1), ("process", 2)):
            comp = RewardComponent(name="ocr", pool=pool, workers=workers)
            rs = RewardSet([comp], [build_reward("ocr", {})], 300.0, 0, 0.0)
            rs.gather([rs.submit(imgs[:8], prompts[:8], [{}] * 8) for _ in range(workers)])  # load models in each worker
            t0 = time.perf_counter()
            res = rs.gather([rs.submit(imgs[i:i + 8], prompts[i:i + 8], [{}] * 8) for i in range(0, 32, 8)])
            row.append(32 / (time.perf_counter() - t0))
            score = float(res.total.mean())
            rs.close()
        print(f"{size:>5}" + "".join(f"{v:>11.1f} " for v in row) + f"{score:>11.2f}")
    try:
        import paddleocr  # noqa: F401
    except ImportError:
        print("paddleocr backend: not installed here (GPU-side extra: pip install 'gerl[paddleocr]')")


def bench_vlm() -> None:
    from tests.rewards.tiny_llava import ServedModel, save_tiny_llava

    root = Path(tempfile.mkdtemp(prefix="gerl_bench_vlm_"))
    server = ServedModel(save_tiny_llava(root / "model"), root / "serve.log")
    try:
        imgs, prompts = text_images(32, 64)
        print("VLM (vlm_ocr → transformers serve, tiny LLaVA, CPU, 8-token replies): requests/s")
        for in_flight in (1, 4, 16):
            fn = build_reward("vlm_ocr", {"base_url": server.base_url, "model": server.model,
                                          "max_concurrency": in_flight, "max_tokens": 8})
            fn(imgs[:2], prompts[:2], [{}] * 2)
            t0 = time.perf_counter()
            _, extras = fn(imgs, prompts, [{}] * 32)
            print(f"  {in_flight:>2} in flight: {32 / (time.perf_counter() - t0):6.1f} req/s "
                  f"(failed {sum(extras['vlm_failed'])})")
    finally:
        server.stop()


def bench_overlap() -> None:
    from gerl.config import load_config
    from gerl.trainer import Trainer, prepare

    base = ["output_dir=/tmp/gerl_bench_overlap", "overwrite=true", "log.tensorboard=false", "log.progress_bar=false",
            "validation.every=-1"]
    cfg = load_config("recipes/tiny_cpu.yaml", base + ["reward.name=jpeg_compressibility"])
    trainer = Trainer(cfg, prepare(cfg))
    role = trainer.engine.rollout
    role.generate(*trainer.next_prompts(0), 0)
    gen = []
    for s in range(1, 4):
        b, _ = role.generate(*trainer.next_prompts(s), s)
        gen.append((b.timings["generate_s"] + b.timings["decode_s"]) / (len(b) // cfg.sampling.micro_batch_size))
    latency = statistics.median(gen)
    trainer.engine.close()
    cfg = load_config("recipes/tiny_cpu.yaml", base + ["reward.name=delayed", f"reward.kwargs={{seconds: {latency:.4f}}}",
                                                       "reward.workers=1"])
    trainer = Trainer(cfg, prepare(cfg))
    role = trainer.engine.rollout
    n_mb = len(trainer.next_prompts(0)[0]) // cfg.sampling.micro_batch_size
    rows = {True: [], False: []}
    for s in range(1, 9):
        on = s % 2 == 1
        cfg.reward.with_reward = on
        t0 = time.perf_counter()
        b, res = role.generate(*trainer.next_prompts(s), s)
        rows[on].append((time.perf_counter() - t0, b.timings["generate_s"] + b.timings["decode_s"]))
    trainer.engine.close()
    on_t = statistics.median(t for t, _ in rows[True])
    off_t = statistics.median(t for t, _ in rows[False])
    ideal = statistics.median(g for _, g in rows[True]) + latency  # only the last micro-batch's reward exposed
    print(f"with_reward, reward latency = one micro-batch's generation = {latency:.3f} s, {n_mb} micro-batches")
    print(f"  rollout+reward per step: off {off_t:.3f} s, on {on_t:.3f} s, ideal {ideal:.3f} s, "
          f"efficiency ideal/on = {ideal / on_t:.2f}, speed-up off/on = {off_t / on_t:.2f}x")


def main() -> int:
    benches = {"ocr": bench_ocr, "vlm": bench_vlm, "overlap": bench_overlap}
    arg = sys.argv[1] if len(sys.argv) > 1 else ",".join(benches)
    usage = f"usage: {Path(sys.argv[0]).name} [{','.join(benches)}]"
    if arg in ("-h", "--help"):
        print(f"{usage}\n\n{__doc__}")
        return 0
    unknown = [n for n in arg.split(",") if n not in benches]
    if unknown:
        print(f"{usage}: unknown benchmark {unknown[0]!r}", file=sys.stderr)
        return 2
    quiet_libraries()
    for name in arg.split(","):
        benches[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
