#!/usr/bin/env python3
"""axolotl's example configs as a test corpus for eo-ddp (issue #31).

    axolotl_corpus.py select SDIST_DIR OUT_DIR
        Copies, unchanged, the example configs of an axolotl source release (SDIST_DIR: the unpacked
        `pip download axolotl==0.19.0 --no-deps --no-binary :all:`) whose base model is of an
        architecture eo-ddp trains, plus a few of architectures it does not (to check that the
        model_type error comes with the key problems), into OUT_DIR/<path under examples/>, and
        writes OUT_DIR/expect.tsv: path, the architecture of the tiny stand-in checkpoint, and the
        outcome axolotl's own keys call for (see expectation()).
    axolotl_corpus.py templates SDIST_DIR OUT_DIR [LEGACY_CHAT_TEMPLATES_PY]
        Copies, unchanged, every named chat template of the release's
        src/axolotl/utils/chat_templates/templates/ into OUT_DIR (tools/chat_templates), and writes
        OUT_DIR/VERSION: the release and each file's sha256. LEGACY_CHAT_TEMPLATES_PY: axolotl's
        src/axolotl/utils/chat_templates.py of a release before 0.5 (git show
        6d3caadf9:src/axolotl/utils/chat_templates.py), whose LEGACY_TEMPLATES (names later releases
        dropped, which older configs still use) are written from its CHAT_TEMPLATES dict, unchanged.
    axolotl_corpus.py model ARCH OUT_DIR
        The tiny stand-in checkpoint of an expect.tsv architecture (tools/make_tiny_model.py, the tiny
        tokenizer; gpt_oss with the harmony tokens, gemma4 with its turn markers; qwen3_moe_nvfp4
        quantised by tools/make_nvfp4_model.py; a config.json alone for an unsupported one).
    axolotl_corpus.py prepare CONFIG MODEL_DIR DATA_DIR OUT_CONFIG
        Writes OUT_CONFIG: CONFIG's text with only base_model and each dataset's path replaced, by
        MODEL_DIR and by a local JSONL in DATA_DIR written in the shape the dataset entry asks for
        (its type, field_messages, message_property_mappings, ...), from fixtures/tiny-chat.

The architecture is decided from the base model's name (the corpus cannot reach the Hub to read
its config.json); BASE_MODEL_ARCH is that table. A config is selected when its architecture is one
eo-ddp supports, whatever its adapter: full fine-tunes are selected too, since eo-ddp must refuse
them for exactly that reason.
"""
import json
import os
import re
import shutil
import sys

import yaml

# base_model (a regular expression over the Hub name) -> the model_type of its config.json.
BASE_MODEL_ARCH = [
    # NVIDIA modelopt's NVFP4 export of Qwen3-30B-A3B (tools/make_nvfp4_model.py makes the stand-in).
    (r"Qwen3-30B-A3B-NVFP4", "qwen3_moe_nvfp4"),
    (r"Qwen3-(30B-A3B|235B-A22B)", "qwen3_moe"),
    (r"Qwen1\.5-MoE|Qwen2-57B-A14B", "qwen2_moe"),
    (r"Mixtral", "mixtral"),
    (r"OLMoE", "olmoe"),
    (r"GLM-4\.5(-Air)?$|GLM-4\.6$", "glm4_moe"),
    (r"GLM-4\.7-Flash", "glm4_moe_lite"),
    (r"DeepSeek-V2", "deepseek_v2"),
    (r"DeepSeek-V3|Kimi-K2|Moonlight", "deepseek_v3"),
    (r"gpt-oss", "gpt_oss"),
    # Mistral Small 4 as the Hub ships it: Mistral 3's multimodal model around a mistral4 text model
    # (the configs' regex targets name model.language_model.layers).
    (r"Mistral-Small-4", "mistral3_mistral4"),
    (r"gemma-4-26B-A4B$", "gemma4"),
    # Scout and Maverick (axolotl's examples use its linearized NF4 checkpoints of them).
    (r"Llama-4-(Scout|Maverick)", "llama4"),
    (r"Qwen3-Next-80B-A3B-Instruct$", "qwen3_next"),
    # Qwen3.5's MoE models as the Hub ships them: the multimodal wrapper around qwen3_5_moe_text.
    (r"Qwen3\.5-(35B-A3B|122B-A10B)", "qwen3_5_moe"),
    (r"MiniMax-M2$", "minimax_m2"),
]
SUPPORTED = {"qwen3_moe", "qwen3_moe_nvfp4", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "glm4_moe_lite", "deepseek_v2",
             "deepseek_v3", "gpt_oss", "gemma4", "llama4", "mistral3_mistral4", "qwen3_next", "qwen3_5_moe",
             "minimax_m2"}
# Adapter configs of unsupported architectures kept in the corpus: each must list the model_type
# error together with its key problems in one run.
UNSUPPORTED_SAMPLE = set()


def arch_of(base_model):
    for pattern, arch in BASE_MODEL_ARCH:
        if re.search(pattern, base_model or ""):
            return arch
    return None


# The in-scope rejections (FSDP, DeepSpeed, expert parallel, full fine-tune, 8-bit loading, new
# tokens) as eo-ddp words them; each is decided here from the keys axolotl reads, not from eo-ddp.
IN_SCOPE = {
    "fsdp": "FSDP shards every weight",
    "dp_shard": "sharded data parallelism is FSDP",
    "deepspeed": "DeepSpeed/ZeRO partitions",
    "expert_parallel": "expert parallelism places different experts",
    "full": "eo-ddp trains adapters only",
    "unfrozen": "a full or partial fine-tune of base weights",
    "8bit": "8-bit loading is not supported",
    "tokens": "eo-ddp adds no tokens",
}
# Problems beyond those, each with why it is right (path -> texts).
EXTRA = {
    # warmup_steps is an int in axolotl's schema: pydantic refuses 0.1 as well.
    "expert_parallel/qwen3_30ba3b_ep_fft_4gpu.yaml": ["warmup_steps: expected an integer"],
    "expert_parallel/qwen3_30ba3b_ep_fsdp_fft_4gpu.yaml": ["warmup_steps: expected an integer"],
    "expert_parallel/qwen3_30ba3b_ep_lora_4gpu.yaml": ["warmup_steps: expected an integer"],
    # Vision data: eo-ddp reads text formats only.
    "mistral4/fft-vision.yml": ["processor_type: not supported"],
    "mistral4/qlora-vision.yml": ["processor_type: not supported"],
    "llama-4/scout-vision-qlora-fsdp2-flex.yaml": ["processor_type: not supported"],
    "llama-4/do-no-use-fa2/scout-vision-qlora-fsdp.yaml": ["processor_type: not supported"],
    "qwen3.5/35b-a3b-moe-vision-lora.yaml": ["processor_type: not supported"],
}
# Refused for what eo-ddp does not implement (not an in-scope rejection): a gap, listed as such.
# None left: the last, qwen3/30b-a3b-nvfp4-lora.yaml's nvfp4_merge_aware, is implemented.
GAPS = {}


def expectation(rel, cfg, arch):
    """(outcome, texts): ok, refused (each problem an in-scope rejection or a listed one) or
    unsupported (the model_type error, with the key problems beside it)."""
    reasons = []
    plugins = cfg.get("plugins") or []
    if cfg.get("fsdp") or cfg.get("fsdp_config"):
        reasons.append(IN_SCOPE["fsdp"])
    if (cfg.get("dp_shard_size") or 1) > 1:
        reasons.append(IN_SCOPE["dp_shard"])
    if cfg.get("deepspeed"):
        reasons.append(IN_SCOPE["deepspeed"])
    if any("ExpertParallel" in p for p in plugins) or (cfg.get("expert_parallel_size") or 1) > 1:
        reasons.append(IN_SCOPE["expert_parallel"])
    if not cfg.get("adapter"):
        reasons.append(IN_SCOPE["full"])
    # lora_modules_to_save trains whole copies of base modules (lm_head, embed_tokens) beside the adapter.
    if cfg.get("unfrozen_parameters") or cfg.get("lora_modules_to_save"):
        reasons.append(IN_SCOPE["unfrozen"])
    if cfg.get("load_in_8bit"):
        reasons.append(IN_SCOPE["8bit"])
    if cfg.get("tokens"):
        reasons.append(IN_SCOPE["tokens"])
    reasons += EXTRA.get(rel, []) + GAPS.get(rel, [])
    if arch not in SUPPORTED:
        return "unsupported", ["model_type '%s' is not supported" % arch] + reasons
    return ("refused" if reasons else "ok"), reasons


# Named templates of axolotl before 0.5 that later releases dropped (inst became mistral_v1 with
# other spacing); older configs still name them.
LEGACY_TEMPLATES = ["inst"]


def templates(sdist, out, legacy_py=None):
    import ast
    import hashlib
    src = os.path.join(sdist, "src", "axolotl", "utils", "chat_templates", "templates")
    version = os.path.basename(os.path.normpath(sdist))  # axolotl-X.Y.Z, as the sdist unpacks
    os.makedirs(out, exist_ok=True)
    shutil.copyfile(os.path.join(sdist, "LICENSE"), os.path.join(out, "LICENSE"))  # Apache-2.0
    lines = ["# axolotl's named chat templates, copied unchanged by tools/axolotl_corpus.py templates from",
             "# %s (src/axolotl/utils/chat_templates/templates/; Apache-2.0): file, sha256" % version]

    def record(name):
        with open(os.path.join(out, name + ".jinja"), "rb") as fh:
            lines.append("%s.jinja\t%s" % (name, hashlib.sha256(fh.read()).hexdigest()))
    for f in sorted(os.listdir(src)):
        if f.endswith(".jinja"):
            shutil.copyfile(os.path.join(src, f), os.path.join(out, f))
            record(f[:-6])
    if legacy_py:
        # The dict literal, read without importing axolotl.
        tree = ast.parse(open(legacy_py, encoding="utf-8").read())
        table = next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                     and any(getattr(t, "id", None) == "CHAT_TEMPLATES" for t in n.targets))
        lines.append("# from axolotl before 0.5 (src/axolotl/utils/chat_templates.py at 6d3caadf9, CHAT_TEMPLATES):")
        for name in LEGACY_TEMPLATES:
            with open(os.path.join(out, name + ".jinja"), "w", encoding="utf-8") as fh:
                fh.write(table[name])
            record(name)
    with open(os.path.join(out, "VERSION"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def select(sdist, out):
    examples = os.path.join(sdist, "examples")
    rows = []
    for root, _, files in os.walk(examples):
        for f in sorted(files):
            if not f.endswith((".yml", ".yaml")):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, examples)
            with open(path) as fh:
                cfg = yaml.safe_load(fh)
            if not isinstance(cfg, dict):
                continue
            arch = arch_of(cfg.get("base_model"))
            if arch is None or (arch not in SUPPORTED and rel not in UNSUPPORTED_SAMPLE):
                continue
            dest = os.path.join(out, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(path, dest)
            outcome, texts = expectation(rel, cfg, arch)
            rows.append((rel, arch, outcome, " | ".join(texts)))
    rows.sort()
    shutil.copyfile(os.path.join(sdist, "LICENSE"), os.path.join(out, "LICENSE"))  # Apache-2.0
    with open(os.path.join(out, "expect.tsv"), "w") as fh:
        fh.write("# written by tools/axolotl_corpus.py select: path, tiny architecture, outcome (ok: --check passes and "
                 "3 steps train; refused / unsupported: exit 2), the texts ' | ' that must each be in the problems, "
                 "every problem holding one of them\n")
        for r in rows:
            fh.write("\t".join(r) + "\n")
    for r in rows:
        print("\t".join(r))
    print("selected %d configs" % len(rows), file=sys.stderr)


# gpt-oss's tokenizer as far as its configs rely on it: the harmony tokens (eot_tokens: <|end|>) and a
# template that renders a message's thinking field (template_thinking_key) in the analysis channel.
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]
HARMONY_TEMPLATE = (
    "{%- set tk = template_thinking_key | default('thinking') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- if message[tk] %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + message[tk] + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")


# Gemma 4's turn markers, which its configs' eot_tokens name (<turn|>) and its chat template renders.
GEMMA4_TOKENS = ["<|turn>", "<turn|>"]
# Llama 4's tokenizer as far as its configs and the llama4 template rely on it (special_tokens pad /
# eos, the header and end-of-turn tokens).
LLAMA4_TOKENS = ["<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>", "<|python_start|>", "<|python_end|>",
                 "<|image|>", "<|finetune_right_pad|>"]


def add_special_tokens(out, tokens):
    """TOKENS as special added tokens of OUT/tokenizer.json, after its last id."""
    with open(os.path.join(out, "tokenizer.json")) as fh:
        tok = json.load(fh)
    next_id = max(max(tok["model"]["vocab"].values()), max(a["id"] for a in tok["added_tokens"])) + 1
    for i, t in enumerate(tokens):
        tok["added_tokens"].append({"id": next_id + i, "content": t, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    with open(os.path.join(out, "tokenizer.json"), "w") as fh:
        json.dump(tok, fh)


FAMILY_TOKENS = {"gpt_oss": HARMONY_TOKENS, "gemma4": GEMMA4_TOKENS, "llama4": LLAMA4_TOKENS}


def make_model(arch, out, root):
    """The tiny stand-in checkpoint of ARCH in OUT, with the tiny tokenizer of fixtures/tiny-qwen3-moe."""
    import subprocess
    os.makedirs(out, exist_ok=True)
    tok_dir = os.path.join(root, "fixtures", "tiny-qwen3-moe")
    if arch == "qwen3_moe_nvfp4":
        # A tiny Qwen3-MoE quantised to NVFP4 in modelopt's checkpoint layout.
        plain = out + ".float"
        subprocess.run([sys.executable, os.path.join(root, "tools", "make_tiny_model.py"), "--arch", "qwen3_moe", "--out",
                        plain], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, os.path.join(root, "tools", "make_nvfp4_model.py"), plain, out], check=True,
                       stdout=subprocess.DEVNULL)
        shutil.rmtree(plain)
    elif arch == "llama4":
        # Llama 4 as axolotl's examples load it: the multimodal wrapper, its experts linearized
        # (experts.gate_projs.{e} ..., axolotl's Llama-4-*-Linearized checkpoints).
        subprocess.run([sys.executable, os.path.join(root, "tools", "make_tiny_model.py"), "--arch", "llama4_mm",
                        "--per-expert-experts", "--out", out], check=True, stdout=subprocess.DEVNULL)
    elif arch in SUPPORTED:
        # Gemma 4 and Mistral Small 4 as the Hub ships them: a multimodal wrapper around the MoE text model.
        tiny = {"gemma4": "gemma4_mm", "mistral3_mistral4": "mistral4_mm", "qwen3_5_moe": "qwen3_5_moe_mm"}.get(arch, arch)
        subprocess.run([sys.executable, os.path.join(root, "tools", "make_tiny_model.py"), "--arch", tiny, "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
    else:
        # An architecture eo-ddp does not train: its config.json is all --check reads before refusing it.
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump({"model_type": arch}, fh)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tok_dir, f), os.path.join(out, f))
    if arch in FAMILY_TOKENS:
        add_special_tokens(out, FAMILY_TOKENS[arch])
    if arch == "gpt_oss":
        with open(os.path.join(out, "tokenizer_config.json")) as fh:
            tc = json.load(fh)
        tc["chat_template"] = HARMONY_TEMPLATE
        with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
            json.dump(tc, fh, indent=1)


def rows_needed(cfg, entry):
    """Rows enough for 3 optimizer steps of one micro-batch (tests/axolotl_upstream.sh trains with
    gradient_accumulation_steps 1) after ENTRY's split slice and the held-out share, with a margin
    (a packed sequence of sequence_len holds about sequence_len / 150 of the tiny rows)."""
    per_step = cfg.get("micro_batch_size") or 1
    per_seq = max(1, (cfg.get("sequence_len") or 2048) // 100) if cfg.get("sample_packing") else 1
    share = 1.0
    m = re.search(r"\[(\d*)%?:(\d*)(%?)\]", str(entry.get("split") or ""))
    if m and m.group(3):
        share = (float(m.group(2) or 100) - float(m.group(1) or 0)) / 100.0
    val = cfg.get("val_set_size") or 0
    share *= 1.0 - (val if val < 1 else 0)
    return int(3 * per_step * per_seq / share) + 1


def write_data(entry, dest, root, rows=48):
    """A local JSONL in the shape DATASETS entry ENTRY reads, from the tiny chat / alpaca fixtures
    (their rows repeated to ROWS at least)."""
    kind = entry.get("type") or "chat_template"
    kind = kind if isinstance(kind, str) else "chat_template"
    fixtures = os.path.join(root, "fixtures", "tiny-chat")
    def repeated(name):
        with open(os.path.join(fixtures, name)) as fh:
            lines = fh.read().splitlines()
        return [lines[i % len(lines)] for i in range(max(rows, len(lines)))]

    if kind.startswith("alpaca") or kind == "completion":
        with open(dest, "w") as out:
            out.write("\n".join(repeated("alpaca.jsonl" if kind != "completion" else "completion.jsonl")) + "\n")
        return
    maps = entry.get("message_property_mappings") or {}
    role_key = maps.get("role") or entry.get("message_field_role") or "role"
    content_key = maps.get("content") or entry.get("message_field_content") or "content"
    sharegpt_roles = role_key == "from"  # ShareGPT data (FineTome and the like) name the roles human / gpt
    thinking = entry.get("field_thinking")
    with open(dest, "w") as out:
        for i, line in enumerate(repeated("chat.jsonl")):
            msgs = []
            for m in json.loads(line)["messages"]:
                role = {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]) if sharegpt_roles else m["role"]
                row = {role_key: role, content_key: m["content"]}
                if thinking and m["role"] == "assistant":
                    row[thinking] = "Think about it, step %d." % i
                msgs.append(row)
            out.write(json.dumps({entry.get("field_messages") or "messages": msgs}) + "\n")


def prepare(config, model, data_dir, out_config, root):
    """CONFIG's text with only base_model and the dataset paths replaced (the rest byte for byte)."""
    with open(config) as fh:
        text = fh.read()
    cfg = yaml.safe_load(text)
    text, n = re.subn(r"(?m)^base_model:.*$", "base_model: " + model, text)
    assert n == 1, "%s: one base_model line expected" % config
    os.makedirs(data_dir, exist_ok=True)
    name = os.path.splitext(os.path.basename(out_config))[0]
    lines = text.split("\n")
    cursor = 0
    for section in ("datasets", "test_datasets"):
        for k, entry in enumerate(cfg.get(section) or []):
            dest = os.path.join(data_dir, "%s-%s-%d.jsonl" % (name, section, k))
            write_data(entry, dest, root, rows_needed(cfg, entry))
            # The entry's `path:` line, the next one after the previous entry's.
            pat = re.compile(r"^(\s*(?:-\s+)?path:\s*)" + re.escape(str(entry["path"])) + r"\s*(#.*)?$")
            while not pat.match(lines[cursor]):
                cursor += 1
            lines[cursor] = pat.sub(lambda m: m.group(1) + dest, lines[cursor])
    with open(out_config, "w") as fh:
        fh.write("\n".join(lines))


if __name__ == "__main__":
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = sys.argv[1:2]
    if cmd == ["select"] and len(sys.argv) == 4:
        select(sys.argv[2], sys.argv[3])
    elif cmd == ["templates"] and len(sys.argv) in (4, 5):
        templates(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) == 5 else None)
    elif cmd == ["model"] and len(sys.argv) == 4:
        make_model(sys.argv[2], sys.argv[3], here)
    elif cmd == ["prepare"] and len(sys.argv) == 6:
        prepare(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], here)
    else:
        sys.exit(__doc__)
