//! What the gates measured: one [`GateRow`] per gate, every tensor's errors, and the report
//! as a table (the CLI) or JSON (`--json`, the browser page).

use serde::Serialize;

use super::CheckConfig;
use crate::golden::Golden;

/// The gates of `syncstep check`, each comparing two programs on the same activation pattern
/// (docs/design.md, "The equivalence gates"). Their names and meanings are this one table's:
/// the report, the page (through wasm-bindgen) and the tests take them from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Gate {
    Test,
    TestLoss,
    TestLogits,
    Control,
    Repeat,
    Portable,
    PortableLoss,
    Drift,
    Tie,
    TieLoss,
}

impl Gate {
    pub const ALL: [Gate; 10] = [
        Gate::Test,
        Gate::TestLoss,
        Gate::TestLogits,
        Gate::Control,
        Gate::Repeat,
        Gate::Portable,
        Gate::PortableLoss,
        Gate::Drift,
        Gate::Tie,
        Gate::TieLoss,
    ];

    /// The name the report gives it, and `--json`'s `gate`.
    pub fn name(self) -> &'static str {
        self.entry().0
    }

    /// What it compares, in a line.
    pub fn meaning(self) -> &'static str {
        self.entry().1
    }

    fn entry(self) -> (&'static str, &'static str) {
        match self {
            Gate::Test => ("TEST", "R replicas × N vs one device at R·N: every gradient, bitwise"),
            Gate::TestLoss => ("TEST loss", "the same: loss"),
            Gate::TestLogits => ("TEST logits", "the same: logits"),
            Gate::Control => {
                ("CONTROL", "per-replica (unsynced) BatchNorm vs one device: must differ")
            }
            Gate::Repeat => ("REPEAT", "the same data-parallel step twice: bitwise"),
            Gate::Portable => {
                ("PORTABLE", "this browser vs the native golden, same pattern: gradients")
            }
            Gate::PortableLoss => ("PORTABLE loss", "this browser vs the native golden: loss"),
            Gate::Drift => ("DRIFT", "K SGD steps, data-parallel vs single: parameters, bitwise"),
            Gate::Tie => ("TIE", "one device vs the f64 reference"),
            Gate::TieLoss => ("TIE loss", "one device vs the f64 reference: loss"),
        }
    }
}

impl std::fmt::Display for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

/// Which side of its bound a gate's figure must fall on; or that the gate does not apply to
/// this configuration (it then passes, and its note says why).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bound {
    AtMost(f64),
    AtLeast(f64),
    NotApplicable,
}

impl Bound {
    pub fn holds(&self, measured: f64) -> bool {
        match *self {
            Bound::AtMost(b) => measured <= b,
            Bound::AtLeast(b) => measured >= b,
            Bound::NotApplicable => true,
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq)]
pub struct GateRow {
    pub gate: Gate,
    pub measured: f64,
    pub bound: Bound,
    /// The parameter tensor with the largest error, for gates over tensors.
    pub worst: Option<String>,
    /// Activation units (ReLU + pool) that flipped, where the gate has a pattern to compare.
    pub flips: Option<usize>,
    /// Anything the figure alone does not say ("bitwise 0", "replicas bitwise equal").
    pub note: String,
    pub pass: bool,
}

/// One parameter tensor's errors, for a per-tensor chart (norm-rel, as the gates).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorErrors {
    pub name: String,
    pub test: f64,
    pub control: f64,
    /// Against the golden, when PORTABLE ran.
    pub portable: Option<f64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CheckReport {
    pub config: CheckConfig,
    /// Each replica's adapter, in replica order.
    pub replica_adapters: Vec<String>,
    pub single_adapter: String,
    /// The adapter the PORTABLE golden was made on, when PORTABLE ran.
    pub portable_against: Option<String>,
    pub rows: Vec<GateRow>,
    /// Every parameter tensor, in model order.
    pub tensors: Vec<TensorErrors>,
    /// TEST's single-device step (global batch, on the data-parallel pattern), summarised for
    /// another build's PORTABLE gate.
    pub golden: Golden,
}

/// A gate's row as reports write it: `{gate, measured, bound, bound_kind, worst_tensor, flips,
/// note, pass}` (a bound that does not apply is null).
#[derive(Serialize)]
struct GateJson<'a> {
    gate: &'static str,
    measured: f64,
    bound: f64,
    bound_kind: &'static str,
    worst_tensor: &'a Option<String>,
    flips: Option<usize>,
    note: &'a str,
    pass: bool,
}

impl Serialize for GateRow {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (bound_kind, bound) = match self.bound {
            Bound::AtMost(b) => ("at_most", b),
            Bound::AtLeast(b) => ("at_least", b),
            Bound::NotApplicable => ("not_applicable", f64::NAN),
        };
        GateJson {
            gate: self.gate.name(),
            measured: self.measured,
            bound,
            bound_kind,
            worst_tensor: &self.worst,
            flips: self.flips,
            note: &self.note,
            pass: self.pass,
        }
        .serialize(serializer)
    }
}

/// A check's report as `--json` writes it and the page reads it.
#[derive(Serialize)]
struct ReportJson<'a> {
    check: &'static str,
    arch: &'static str,
    replicas: usize,
    batch_per_replica: usize,
    global_batch: usize,
    shard_sizes: Vec<usize>,
    image_size: u32,
    classes: u32,
    steps: usize,
    seed: u64,
    sabotage: Option<String>,
    replica_adapters: &'a [String],
    single_adapter: &'a str,
    portable_against: &'a Option<String>,
    pass: bool,
    gates: &'a [GateRow],
    tensors: &'a [TensorErrors],
}

pub(super) fn row(
    gate: Gate,
    measured: f64,
    bound: Bound,
    worst: Option<String>,
    flips: Option<usize>,
    note: String,
) -> GateRow {
    GateRow { gate, measured, bound, worst, flips, note, pass: bound.holds(measured) }
}

impl CheckReport {
    pub fn passed(&self) -> bool {
        self.rows.iter().all(|r| r.pass)
    }

    pub fn row(&self, gate: Gate) -> Option<&GateRow> {
        self.rows.iter().find(|r| r.gate == gate)
    }

    /// The report as a plain-text table, with the adapters and the configuration above it.
    pub fn table(&self) -> String {
        let c = &self.config;
        let mut out = format!(
            "{} ({}×{}, {} classes, seed {}) against one device at {}\n",
            c.shards_text(),
            c.image_size,
            c.image_size,
            c.classes,
            c.seed,
            c.global()
        );
        for (r, a) in self.replica_adapters.iter().enumerate() {
            out += &format!("  replica {r}: {a}\n");
        }
        out += &format!("  single:    {}\n", self.single_adapter);
        if let Some(a) = &self.portable_against {
            out += &format!("  PORTABLE against a golden made on: {a}\n");
        }
        if let Some(s) = c.sabotage {
            out += &format!("  SABOTAGED on purpose: {s:?}\n");
        }
        out += &format!(
            "\n{:<13} {:>10}  {:<12} {:<32} {:>6}  {:<6} {}\n",
            "gate", "measured", "bound", "worst tensor", "flips", "result", "note"
        );
        for r in &self.rows {
            let bound = match r.bound {
                Bound::AtMost(0.0) => "bitwise".to_string(),
                Bound::AtMost(b) => format!("≤ {b:.0e}"),
                Bound::AtLeast(b) => format!("≥ {b:.1e}"),
                Bound::NotApplicable => "-".to_string(),
            };
            let measured =
                if r.measured.is_nan() { "-".into() } else { format!("{:.3e}", r.measured) };
            let flips = r.flips.map_or("-".to_string(), |f| f.to_string());
            let result = if r.pass { "PASS" } else { "FAIL" };
            out += &format!(
                "{:<13} {:>10}  {:<12} {:<32} {:>6}  {:<6} {}\n",
                r.gate,
                measured,
                bound,
                r.worst.as_deref().unwrap_or("-"),
                flips,
                result,
                r.note
            );
        }
        out
    }

    /// The report as JSON (non-finite figures are null).
    pub fn to_json(&self) -> String {
        let c = &self.config;
        let shards = crate::data::shard_ranges(c.global(), c.replicas);
        let report = ReportJson {
            check: "equivalence",
            arch: c.arch.name(),
            replicas: c.replicas,
            batch_per_replica: c.batch,
            global_batch: c.global(),
            shard_sizes: shards.map(|r| r.iter().map(|s| s.len()).collect()).unwrap_or_default(),
            image_size: c.image_size,
            classes: c.classes,
            steps: c.steps,
            seed: c.seed,
            sabotage: c.sabotage.map(|s| format!("{s:?}")),
            replica_adapters: &self.replica_adapters,
            single_adapter: &self.single_adapter,
            portable_against: &self.portable_against,
            pass: self.passed(),
            gates: &self.rows,
            tensors: &self.tensors,
        };
        serde_json::to_string(&report).expect("a report serialises")
    }
}
