#include "launch/usage.h"

#include <utility>
#include <vector>

namespace eo::launch {
namespace {

// One entry per command: its synopsis (the overview's line) and the rest of its usage.
struct CommandUsage {
  const char* name;
  const char* synopsis;
  const char* details;
};

const std::vector<CommandUsage>& commands() {
  static const std::vector<CommandUsage> c = {
      {"train", "eo-ddp [train] --config FILE [--set key=value ...] [--check]",
       R"(Train a LoRA / QLoRA adapter as the YAML config says (axolotl's key names; the keys:
eo-ddp --help-config). With --check: validate, print the resolved config and the memory plan, load
nothing.
  --config FILE      the YAML config; relative paths in it are resolved against the folder it is in
                     (a path found only under the current folder is used from there, with a warning)
  --set key=value    override one key (dotted for nested keys, values are YAML scalars), e.g.
                     --set gradient_checkpointing_kwargs.use_reentrant=false --set learning_rate=1e-4;
                     relative paths given here are resolved against the current folder
  --check            exit 0 when the config is valid and the run fits device_memory_limit (or, on a
                     GPU, the first GPU's free memory); exit 2 when it is invalid or does not fit,
                     listing what to change
When the run does not fit, training stops before loading any weight (exit 2) and lists the
changes that make it fit, each with its predicted peak.)"},
      {"preprocess", "eo-ddp preprocess --config FILE [--set key=value ...]",
       R"(Tokenise the chat_template / alpaca / completion / input_output datasets into
dataset_prepared_path with the model's tokenizer (Python transformers); train does it too when the
cache is missing or stale.)"},
      {"score",
       "eo-ddp score --model DIR [--adapter DIR] --data FILE [--dtype fp32|bf16] [--[no-]load-in-4bit] [--window N]",
       R"(Mean next-token loss of a checkpoint (and optional peft adapter) on tokenized JSONL; the
base is NF4 or not as the adapter was trained (its eo_ddp_base.json) unless a flag says otherwise.
  --dtype fp32|bf16                  the compute dtype
  --load-in-4bit, --no-load-in-4bit  score on the NF4 base, or on the stored weights
  --window N                         rows longer than N tokens (default 8192) are scored in windows
                                     sharing one token
  --json                             print the result as one JSON object)"},
      {"merge",
       "eo-ddp merge --model DIR --adapter DIR --output DIR [--base original|as-trained] [--dtype bf16|fp16|fp32]",
       R"(Merge a peft adapter into its base: a checkpoint folder in the base's layout (sharded safetensors
with an index, config.json, generation config, tokenizer files) that loads as the base does. Streams
shard by shard: host memory stays near one input plus one output shard.
  --base original      into the base's own weights, as peft's merge_and_unload (default)
  --base as-trained    into the base the adapter was trained on (its eo_ddp_base.json): with QLoRA
                       every decoder-block linear as its NF4 round trip, the model training ran
  --dtype D            the written tensors' dtype (default: the base's config.json dtype); use fp32
                       to keep an as-trained merge exact
  --max-shard-size S   largest output shard (default 5GB))"},
      {"generate",
       "eo-ddp generate --model DIR [--adapter DIR] (--prompt TEXT | --chat FILE | --prompt-ids IDS) ...",
       R"(Continue a prompt with the model (and adapter): the prompt through the model's chat template (a
user turn, or the messages of FILE: a JSON list of {"role", "content"}), tokens streamed to stdout
until an end-of-turn token or --max-new-tokens, then the prefill and decode rates. The prompt runs
once, then each new token alone against the layers' cached keys and values (delta-rule layers: their
recurrent and conv state).
  --temperature T      0 (default): greedy; above 0: sampled at that temperature
  --top-p P            sample from the smallest set of tokens whose probability reaches P (default 1)
  --max-new-tokens N   at most N new tokens (default 128)
  --seed S             the sampler's seed (default 0)
  --raw                the prompt as it is, without the chat template
  --prompt-ids IDS     the prompt as token ids (1,2,3), no tokenizer; stops at config's eos_token_id
  --dtype fp32|bf16    the compute dtype (default fp32)
  --load-in-4bit       on the NF4 base (default: the base the adapter trained on, else as stored)
  --no-load-in-4bit    on the base as stored, whatever the adapter trained on
  --expert-offload     the 4-bit experts in host RAM, streamed into a device slot block by block as
                       in training (default: as the adapter trained); --no-expert-offload: held
  --expert-offload-vram-budget SIZE   with --expert-offload: keep the blocks that fit in SIZE on
                       the device (default 0: every block streams)
  --no-kv-cache        run the whole sequence for every new token (no cache)
  --synthetic-weights  seeded random weights (--seed) from config.json alone, for rates on real shapes
  --json               no streaming: print {"prompt_ids", "ids", "prefill_tokens_per_s", "decode_tokens_per_s"}
                       (offloaded: "experts_streamed", the copies as metrics.jsonl counts them))"},
      {"plan", "eo-ddp plan --config FILE [--vram SIZE] [--host-ram SIZE] [--ranks-per-node N] [--card NAME] [--set k=v ...]",
       R"(Predict per-rank peak VRAM and pinned host RAM (per node), and with disk homes the file and
the drive reads per step, from config.json and the config alone (nothing is loaded).
  --vram SIZE          say whether it fits such a card (12GiB, 24GB, ...); when not, list what to
                       change (cheapest first, each re-planned with its peak) and exit 1
  --host-ram SIZE      the same for pinned host RAM per node; without it the pinned RAM is set
                       against this machine's available RAM (and never fails the command)
  --ranks-per-node N   ranks sharing a host (default 1)
  --card NAME          also predict the step time (s/step, tokens/s) on that card: t4, a2000, 3090,
                       4090, 5090, a100, h100, h200; its memory is the --vram unless one is given
  --card-figures F     the same for an unlisted card, given by its figures:
                       bf16_tflops=N,mem_gbps=N,link_gbps=N,vram_gib=N)"},
  };
  return c;
}

}  // namespace

std::string overall_usage() {
  std::string s = "usage:\n";
  for (const auto& c : commands()) s += std::string("  ") + c.synopsis + "\n";
  s += R"(  eo-ddp COMMAND --help           that command's options
  eo-ddp --help-config [KEY]      the config keys, grouped (one key: KEY; markdown: --markdown)
  eo-ddp --help-axolotl-keys      what eo-ddp does with each of axolotl's keys
  eo-ddp --version

Multi-GPU / multi-node: mpirun -np N eo-ddp --config FILE (one rank per GPU).
Exit codes: 0 success, 1 runtime failure (plan: does not fit), 2 bad usage or config (--check and
training: also a run that does not fit), 3 stopped by SIGTERM, SIGINT, SIGUSR1 or SIGHUP with
nothing lost (a checkpoint saved, or stopped before training began).
)";
  return s;
}

std::string command_usage(const std::string& command) {
  for (const auto& c : commands())
    if (command == c.name) return std::string("usage: ") + c.synopsis + "\n\n" + c.details + "\n";
  return "";
}

}  // namespace eo::launch
