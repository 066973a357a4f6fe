"""A tiny random-init LLaVA, built offline, saved where `transformers serve` can load it (test helper).

    python -m tests.rewards.tiny_llava OUT_DIR     # build and save

The tokenizer is byte-level BPE with no merges (one token per byte) plus LLaVA's special tokens, built in code;
the image processor is CLIP's PIL backend (no torchvision); the chat template is LLaVA-1.5's "USER: ... ASSISTANT:".
The weights are random, so the model answers with garbage bytes, which is what the VLM-reward tests want: a real
server returning replies no parser can read.
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


def build_tiny_llava(seed: int = 0):
    """(model, processor): LlavaForConditionalGeneration with a 2-layer CLIP vision tower and a 2-layer Llama."""
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
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
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


def save_tiny_llava(path: str | Path, seed: int = 0) -> Path:
    path = Path(path)
    model, processor = build_tiny_llava(seed)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(save_tiny_llava(sys.argv[1]))
