// SPDX-License-Identifier: Apache-2.0
// flexpert: the command-line entry point.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>

#include "cli/commands.h"

namespace flexpert::cli {

int report_error(const std::string& command, const Status& status) {
  std::fprintf(stderr, "flexpert %s: %s\n", command.c_str(), status.to_string().c_str());
  // A corrupt input file (DataLoss) is bad input too, like a wrong flag.
  const bool user_error = status.code() == StatusCode::kInvalidArgument ||
                          status.code() == StatusCode::kNotFound ||
                          status.code() == StatusCode::kDataLoss;
  return user_error ? 2 : 1;
}

namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Progress::Progress(std::string label) : label_(std::move(label)), start_ms_(now_ms()) {}

void Progress::update(uint64_t done, uint64_t total, const char* unit) {
  const int64_t now = now_ms();
  // Quick operations show nothing; long ones redraw at most every 200 ms.
  if (now - start_ms_ < 300 && !drawn_) return;
  if (done < total && last_ms_ >= 0 && now - last_ms_ < 200) return;
  last_ms_ = now;
  const double pct = total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0;
  std::fprintf(stderr, "\r%s %5.1f%% (%llu/%llu%s)", label_.c_str(), pct,
               static_cast<unsigned long long>(done), static_cast<unsigned long long>(total), unit);
  std::fflush(stderr);
  drawn_ = true;
}

void Progress::finish() {
  if (drawn_) std::fputc('\n', stderr);
  drawn_ = false;
}

}  // namespace flexpert::cli

namespace {

const char kUsage[] =
    "usage: flexpert <command> [flags]\n"
    "commands:\n"
    "  generate  --model DIR --prompt-ids 1,2,3 [--max-tokens 16] [--json] ...\n"
    "  synth     --preset tiny|qwen3-30b-a3b --out DIR [--layers N] [--dtype bf16|f32]\n"
    "  serve     --model DIR --ranks N [--max-ranks M] [--host H --port P] ...\n"
    "  worker    --join HOST:PORT --rank R\n"
    "  eplb plan --input cases.json --output plans.json [--planner flexpert|deepseek]\n"
    "  bench generate [--model DIR | --preset P --layers N] [--batches 1,8,32] ...\n"
    "  bench serve    --url URL --concurrency C --requests N [--prompt-len L --max-tokens T]\n"
    "  bench elastic  [--modes live,stop-the-world] [--events 3:scale:4,9:kill:1,...]\n"
    "  bench slow-clients --url URL [--steps 64,256,1024] [--streams S]\n"
    "  scale     --url URL (--to N | --remove R1,R2) [--admin-key K]\n"
    "  demo      [--out out/demo]   an elastic group under load: scale, kill, report\n"
    "  tokenize    --tokenizer DIR (--text T | --input FILE.jsonl)   prints {\"ids\": [...]}\n"
    "  detokenize  --tokenizer DIR --ids 1,2,3\n"
    "  chat-template --tokenizer DIR --messages FILE.json [--add-generation-prompt]\n"
    "  plan-memory --model DIR --ranks N [--max-ranks M] [--quantization bf16|fp8] [--json]\n"
    "Run `flexpert <command> --help` for the flags of a command.\n";

}  // namespace

int main(int argc, char** argv) {
  using namespace flexpert::cli;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  Args args(argv + 2, argv + argc);
  if (command == "generate") return cmd_generate(args);
  if (command == "synth") return cmd_synth(args);
  if (command == "bench") return cmd_bench(args);
  if (command == "serve") return cmd_serve(args);
  if (command == "worker") return cmd_worker(args);
  if (command == "eplb") return cmd_eplb(args);
  if (command == "scale") return cmd_scale(args);
  if (command == "demo") return cmd_demo(args);
  if (command == "tokenize") return cmd_tokenize(args);
  if (command == "detokenize") return cmd_detokenize(args);
  if (command == "chat-template") return cmd_chat_template(args);
  if (command == "plan-memory") return cmd_plan_memory(args);
  std::fprintf(stderr, "flexpert: unknown command '%s'\n%s", command.c_str(), kUsage);
  return 2;
}
