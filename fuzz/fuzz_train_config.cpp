// libFuzzer: the YAML training config through eo::load_config_text (what load_config_file
// calls with the file's contents). Input: YAML text, then optionally NUL-separated `--set`
// overrides (key=value). A config that loads must print (config_to_yaml) as YAML that loads
// again to the same printout: `eo-ddp --print-config` output is meant to be a runnable config.
#include <cstdint>
#include <string>
#include <vector>

#include "common/error.h"
#include "fuzz/fuzz_common.h"
#include "runtime/config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  for (std::size_t start = 0;;) {
    const std::size_t nul = input.find('\0', start);
    parts.push_back(input.substr(start, nul == std::string::npos ? std::string::npos : nul - start));
    if (nul == std::string::npos) break;
    start = nul + 1;
  }
  const std::string yaml = parts[0];
  const std::vector<std::string> overrides(parts.begin() + 1, parts.end());
  eo::ConfigLoadOptions options;
  options.check_files = false;  // paths are the fuzzer's; existence checks are not parsing
  std::string printed;
  try {
    const eo::TrainConfig cfg = eo::load_config_text(yaml, "fuzz.yaml", overrides, options);
    printed = eo::config_to_yaml(cfg);
    (void)eo::resolve_compute(cfg, true, false);
  } catch (const eo::Error&) {
    return 0;
  }
  try {
    const eo::TrainConfig again = eo::load_config_text(printed, "printed.yaml", {}, options);
    EO_FUZZ_ASSERT(eo::config_to_yaml(again) == printed);
  } catch (const eo::Error& e) {
    std::fprintf(stderr, "eo-fuzz: the printed config does not load again: %s\n--- printed:\n%s\n", e.what(),
                 printed.c_str());
    std::abort();
  }
  return 0;
}
