// The GPUs a plan can be made for: one row per card in cards.cpp (its memory, its dense tensor
// rate, its memory bandwidth and the pinned host-to-device rate over its link), read by
// `eo-ddp plan --card` (the step time) and `eo-bench --card` (a card simulated on a bigger GPU).
// An unlisted card is given by its figures (`--card-figures`).
#pragma once

#include <string>
#include <vector>

namespace eo {

struct CardFigures {
  std::string name;
  double vram_gib = 0;     // device memory as the driver reports it
  double bf16_tflops = 0;  // dense tensor-core rate, bf16 with fp32 accumulation (fp16 on cards without bf16)
  double mem_gbps = 0;     // device memory bandwidth, GB/s
  double link_gbps = 0;    // pinned host-to-device copies over its usual link, GB/s
  std::string what;        // the card's part and link, for the table
  bool flash_attention = true;  // PyTorch's flash kernels run on it (sm_80 and newer)
};

// Every listed card, in the table's order.
const std::vector<CardFigures>& known_cards();
// "a2000, t4, 3090, ...": for messages.
std::string known_card_names();
// The listed card named `name` (case-insensitive); a UsageError naming `flag` and the known cards when
// there is none.
CardFigures find_card(const std::string& name, const std::string& flag = "--card");
// An unlisted card from "bf16_tflops=..,mem_gbps=..,link_gbps=..,vram_gib=.." (every key once, all
// four required, each a positive number); a UsageError naming the key and the form otherwise.
CardFigures card_from_figures(const std::string& text, const std::string& flag = "--card-figures");
// The card's memory as a config size, "24GiB" (device_memory_limit).
std::string card_memory(const CardFigures& card);

}  // namespace eo
