"""A tiny random-init LLaVA, built offline, saved where `transformers serve` can load it (test helper).

    python -m tests.rewards.tiny_llava OUT_DIR [HEAD_DIM]     # build and save (head_dim 16 by default)

The tokenizer is byte-level BPE with no merges (one token per byte) plus LLaVA's special tokens, built in code;
the image processor is CLIP's PIL backend (no torchvision); the chat template is LLaVA-1.5's "USER: ... ASSISTANT:".
The weights are random, so the model answers with garbage bytes, which is what the VLM-reward tests want: a real
server returning replies no parser can read. Both towers have 2 attention heads of `head_dim` channels: 16 keeps
`transformers serve` fast; vLLM's CPU attention kernel rejects 16 and takes 64 (scripts/vllm_check.sh).
"""

from __future__ import annotations

import sys
from pathlib import Path

IMAGE_SIZE = 32  # pixels; CLIP patches of 8 -> 16 image tokens per image
PATCH_SIZE = 8
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"}, model_max_length=512,
    )
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_llava(seed: int = 0, head_dim: int = 16):
    """(model, processor): LlavaForConditionalGeneration with a 2-layer CLIP vision tower and a 2-layer Llama, each
    with 2 heads of `head_dim` channels (hidden size 2 * head_dim)."""
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = build_tokenizer()
    hidden = 2 * head_dim
    vision = CLIPVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                              projection_dim=hidden)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2, vision_feature_layer=-1,
                         vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.max_new_tokens = 16
    model.generation_config.do_sample = False
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH_SIZE,
                               vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                               num_additional_image_tokens=1)  # CLIP's CLS token, dropped by "default"
    return model, processor


def save_tiny_llava(path: str | Path, seed: int = 0, head_dim: int = 16) -> Path:
    """Save model and processor; the weights in the llava-hf hub layout (see `to_hub_layout`)."""
    path = Path(path)
    model, processor = build_tiny_llava(seed, head_dim)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    to_hub_layout(path / "model.safetensors")
    return path


def to_hub_layout(file: Path) -> None:
    """Rename the vision tower's weights to the layout of the llava-hf checkpoints on the hub.

    transformers 5 saves `vision_tower.embeddings...`; the hub's checkpoints (and so vLLM's LLaVA loader) have
    `vision_tower.vision_model.embeddings...`. transformers loads either layout.
    """
    from safetensors.torch import load_file, save_file

    state = load_file(file)
    renamed = {("vision_tower.vision_model." + k[len("vision_tower."):]
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
               for k, v in state.items()}
    save_file(renamed, file, metadata={"format": "pt"})


if __name__ == "__main__":
    print(save_tiny_llava(sys.argv[1], head_dim=int(sys.argv[2]) if len(sys.argv) > 2 else 16))


class ServedModel:
    """`transformers serve MODEL_DIR` on 127.0.0.1 and a free port, as a subprocess; `stop()` always kills it.

    Its stdout and stderr go to `log_path` unbuffered: "[Request received]" is logged when a request starts being
    processed and uvicorn's access line when its response is sent, so the log shows how requests overlapped.
    """

    def __init__(self, model_dir: Path, log_path: Path, startup_timeout_s: float = 300.0):
        import os
        import socket
        import subprocess
        import time
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.model = str(model_dir)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_path
        cache = log_path.parent / "hf_cache"  # /v1/models scans the hub cache: an empty one lists nothing
        cache.mkdir(exist_ok=True)
        env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        exe = Path(sys.executable).with_name("transformers")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [str(exe), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
             "--log-level", "info"], stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"transformers serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"transformers serve not healthy after {startup_timeout_s} s:\n{self.log()[-3000:]}")
            time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def max_overlap(self) -> int:
        """Most requests the server held at once: received but not yet answered, from the log's event order."""
        inside = peak = 0
        for line in self.log().splitlines():
            if "[Request received]" in line:
                inside += 1
                peak = max(peak, inside)
            elif "POST /v1/chat/completions" in line:
                inside = max(inside - 1, 0)
        return peak

    def kill(self) -> None:
        """SIGKILL: the server dies mid-request, as a crashed or preempted one does."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:  # noqa: BLE001 — whatever happens, do not leave it running
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
