// Preemption signal handlers: a sig_atomic_t flag and nothing else (async-signal-safe).
#include "locus/train/checkpoint/preempt.hpp"

#include <signal.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <csignal>
#include <cstring>

#include <fmt/format.h>

#include "locus/comm/error.hpp"

namespace locus::train {

namespace {

volatile std::sig_atomic_t g_pending = 0;
bool g_installed = false;

extern "C" void on_preempt_signal(int signal) { g_pending = signal; }

struct Named {
  const char* name;
  int number;
};
constexpr Named kSignals[] = {{"HUP", SIGHUP},   {"INT", SIGINT},   {"QUIT", SIGQUIT},
                              {"USR1", SIGUSR1}, {"USR2", SIGUSR2}, {"TERM", SIGTERM},
                              {"ALRM", SIGALRM}, {"CONT", SIGCONT}, {"XCPU", SIGXCPU},
                              {"KILL", SIGKILL}, {"STOP", SIGSTOP}};

std::string upper_trimmed(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  std::string out(s);
  std::ranges::transform(out, out.begin(), [](unsigned char c) { return std::toupper(c); });
  if (out.rfind("SIG", 0) == 0) out.erase(0, 3);
  return out;
}

}  // namespace

std::string signal_name(int signal) {
  for (const Named& n : kSignals) {
    if (n.number == signal) return std::string("SIG") + n.name;
  }
  return fmt::format("signal {}", signal);
}

std::vector<int> parse_signals(std::string_view list, std::string_view key) {
  std::vector<int> out;
  const std::string all = upper_trimmed(list);
  if (all.empty() || all == "NONE") return out;
  std::size_t begin = 0;
  while (begin <= list.size()) {
    const std::size_t comma = std::min(list.find(',', begin), list.size());
    const std::string word = upper_trimmed(list.substr(begin, comma - begin));
    begin = comma + 1;
    int number = 0;
    const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), number);
    const bool numeric = !word.empty() && ec == std::errc() && end == word.data() + word.size();
    if (!numeric) {
      number = 0;
      for (const Named& n : kSignals) {
        if (word == n.name) number = n.number;
      }
    }
    if (number <= 0 || number >= NSIG) {
      throw ConfigError(fmt::format("{} = '{}': '{}' is not a signal; use names such as "
                                    "USR1,TERM (or none)", key, list, word));
    }
    if (number == SIGKILL || number == SIGSTOP) {
      throw ConfigError(fmt::format("{} = '{}': {} cannot be caught; use USR1, USR2 or TERM",
                                    key, list, signal_name(number)));
    }
    if (std::ranges::find(out, number) == out.end()) out.push_back(number);
  }
  return out;
}

PreemptSignals::PreemptSignals(const std::vector<int>& signals) : signals_(signals) {
  LOCUS_ASSERT(!g_installed, "only one PreemptSignals may exist at a time");
  g_installed = true;
  g_pending = 0;
  saved_.resize(signals_.size() * sizeof(struct sigaction));
  for (std::size_t i = 0; i < signals_.size(); ++i) {
    struct sigaction sa {};
    sa.sa_handler = on_preempt_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    struct sigaction old {};
    if (::sigaction(signals_[i], &sa, &old) != 0) {
      throw InternalError(fmt::format("cannot install a handler for {}: {}",
                                      signal_name(signals_[i]), std::strerror(errno)));
    }
    std::memcpy(saved_.data() + i * sizeof(struct sigaction), &old, sizeof(old));
  }
}

PreemptSignals::~PreemptSignals() {
  for (std::size_t i = 0; i < signals_.size(); ++i) {
    struct sigaction old {};
    std::memcpy(&old, saved_.data() + i * sizeof(struct sigaction), sizeof(old));
    if (ignore_after_) {
      old.sa_handler = SIG_IGN;
      old.sa_flags = 0;
    }
    ::sigaction(signals_[i], &old, nullptr);
  }
  g_pending = 0;
  g_installed = false;
}

int PreemptSignals::pending() noexcept { return static_cast<int>(g_pending); }

}  // namespace locus::train
