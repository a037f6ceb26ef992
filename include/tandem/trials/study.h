// A study: the study file (YAML), its append-only results file, and the in-process trial API
// for a training loop of one's own, where every rank of the job takes part in each trial.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/trials/pruner.h"
#include "tandem/trials/space.h"

namespace tandem {
class ProcessGroup;
}

namespace tandem::trials {

/// Everything a study file says. Keys (docs/trials.md):
///   program: build/examples/train_gpt      # the trial's program (relative: to the study file)
///   args: [--steps, 60, --project_dir, "{trial_dir}", --log_with, jsonl]
///   launch: {num_processes: 2, cpu: true}  # `tandem launch` flags for every trial
///   space:
///     lr: {type: loguniform, low: 1e-4, high: 3e-2}          # flag --lr
///     width: {type: categorical, choices: [32, 64], flag: --width}
///     DROPOUT: {type: uniform, low: 0, high: 0.2, env: DROPOUT}
///   objective: {metric: loss, mode: min}   # a key of the trial's metrics.jsonl values
///   trials: 20
///   sampler: tpe                           # or {type: tpe, startup_trials: 10, ei_candidates: 24}
///   pruner: median                         # or {type: asha, min_resource: 10, reduction_factor: 3}
///   seed: 0
///   study_dir: sweeps/lr                   # relative: to the study file
///   parallel: 1                            # trials at once, each on its own cores (or GPUs)
/// `{trial_dir}` and `{trial}` in args become the trial's directory and number.
struct StudyConfig {
  std::string program;
  std::vector<std::string> args;
  /// `tandem launch` settings, in file order: (name, value); value "true" for a switch.
  std::vector<std::pair<std::string, std::string>> launch;
  std::vector<ParamSpec> space;
  std::string metric;
  Direction direction = Direction::kMinimize;
  int trials = 10;
  SamplerOptions sampler;
  PrunerOptions pruner;
  uint64_t seed = 0;
  std::string study_dir = "study";
  int parallel = 1;
  /// Where the file was (relative paths are relative to it); empty for a config built in code.
  std::string source;
};

/// Reads and checks a study file: unknown keys, bad types, bad ranges and a missing objective
/// are refused with std::invalid_argument naming the key and the fix. `needs_program`: whether
/// `program` is required (tandem sweep) or not (in-process trials).
StudyConfig load_study(const std::string& path, bool needs_program = true);
StudyConfig parse_study(const std::string& yaml_text, const std::string& source = "",
                        bool needs_program = true);

/// Checks a StudyConfig built in code (the same checks as load_study).
void validate(const StudyConfig& config, bool needs_program);

/// The study's results: `<study_dir>/trials.jsonl`, one JSON object per line, appended and
/// flushed as trials start and end, never rewritten. A start line without an end line is a
/// trial a killed sweep left running: it is run again. `<study_dir>/study.json` keeps the
/// space, objective, sampler and seed; a study started again with different ones is refused.
class ResultsLog {
 public:
  /// Creates study_dir when needed and reads what is there (a half-written last line, from a
  /// kill during a write, is ignored).
  explicit ResultsLog(const StudyConfig& config);
  /// Every trial: finished ones as recorded, unfinished ones (no end line) dropped.
  const std::vector<TrialRecord>& finished() const { return finished_; }
  /// Trial numbers started but never finished (to run again, with the same values).
  const std::vector<TrialRecord>& unfinished() const { return unfinished_; }
  /// The next unused trial number.
  int next_number() const { return next_; }
  void record_start(const TrialRecord& trial);
  void record_end(const TrialRecord& trial);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<TrialRecord> finished_, unfinished_;
  int next_ = 0;
};

/// The best complete trial, or nullptr.
const TrialRecord* best_trial(const std::vector<TrialRecord>& trials, Direction direction);

/// A table: number, state, value, seconds, then one column per parameter; the best marked.
std::string format_trials_table(const std::vector<TrialRecord>& trials,
                                const std::vector<ParamSpec>& space, Direction direction,
                                const std::string& metric);

/// One trial of an in-process study (Study::ask). Its values are the same on every rank.
class Trial {
 public:
  int number() const { return record_.number; }
  const Params& params() const { return record_.params; }
  /// A value as a real number, an integer or a categorical choice's text. Throws
  /// std::invalid_argument naming an unknown parameter.
  double real(const std::string& name) const;
  int64_t integer(const std::string& name) const;
  const std::string& choice(const std::string& name) const;
  /// Reports the objective at a step and returns whether the trial stops here. Collective:
  /// every rank calls it with its own value at the same step; rank 0 takes the mean over ranks,
  /// asks the pruner, and every rank gets the same answer, so that no rank leaves the loop
  /// alone (a pruned trial's remaining collectives would hang the others).
  bool report(int64_t step, double value);
  bool pruned() const { return record_.state == TrialState::kPruned; }
  const TrialRecord& record() const { return record_; }

 private:
  friend class Study;
  TrialRecord record_;
  class Study* study_ = nullptr;
};

/// A study driven from inside one training program: the loop asks for a trial, trains with its
/// values, reports along the way and tells the result. Rank 0 samples and keeps the results
/// file; the values reach every rank as one broadcast over the job's process group.
///
/// Example:
///   tandem::trials::Study study(tandem::trials::load_study("lr.yaml", false),
///                               &acc.process_group());
///   while (auto trial = study.ask()) {
///     double lr = trial->real("lr");
///     ... for (step ...) { ...; if (trial->report(step, loss)) break; }
///     study.tell(*trial, final_loss);   // a pruned trial is recorded as pruned
///   }
///   // study.best() on every rank
class Study {
 public:
  /// `group`: the ranks that take part (nullptr: this process alone). Collective.
  Study(StudyConfig config, ProcessGroup* group = nullptr);
  ~Study();
  /// The next trial, or nullopt when the study has its trials (or the grid is exhausted).
  /// Collective. A trial an earlier, killed run left unfinished is asked again first.
  std::optional<Trial> ask();
  /// Records the trial's objective (collective; rank 0's value is kept). A pruned trial keeps
  /// its last reported value and the state pruned.
  void tell(Trial& trial, double value);
  /// Records a failed trial (collective).
  void tell_failed(Trial& trial, const std::string& message);
  /// Every finished trial (rank 0's record, the same on every rank after ask/tell).
  std::vector<TrialRecord> trials() const;
  /// The best complete trial (every rank).
  std::optional<TrialRecord> best() const;
  const StudyConfig& config() const { return config_; }

 private:
  friend class Trial;
  bool decide_prune(TrialRecord& record, int64_t step, double value);
  StudyConfig config_;
  ProcessGroup* group_;
  std::unique_ptr<ResultsLog> log_;  // rank 0 only
  std::vector<TrialRecord> finished_;
  std::vector<TrialRecord> retry_;
  std::vector<TrialRecord> running_;
  int next_ = 0;
  int asked_ = 0;
};

/// JSON for one record (the results file's end line) and back.
std::string trial_to_json(const TrialRecord& trial);
TrialRecord trial_from_json(const std::string& json);

}  // namespace tandem::trials
