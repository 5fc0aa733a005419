//! How well a model classifies: top-1 and top-5 accuracy, per-class accuracy and the confusion
//! matrix, counted from logits. Ties go to the lower class index, as an argmax would.

use serde::Serialize;

/// Counts over the examples scored so far.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scores {
    pub classes: usize,
    pub examples: usize,
    pub top1_correct: usize,
    pub top5_correct: usize,
    /// Row = true class, column = predicted class: `confusion[truth * classes + predicted]`.
    pub confusion: Vec<u64>,
}

impl Scores {
    pub fn new(classes: u32) -> Scores {
        let classes = classes as usize;
        Scores {
            classes,
            examples: 0,
            top1_correct: 0,
            top5_correct: 0,
            confusion: vec![0; classes * classes],
        }
    }

    /// Scores the logits `[labels.len(), classes]` against `labels`.
    pub fn add(&mut self, logits: &[f32], labels: &[u32]) {
        for (row, &label) in logits.chunks(self.classes).zip(labels) {
            let ranked = ranking(row);
            let truth = label as usize;
            self.examples += 1;
            self.top1_correct += (ranked[0] == truth) as usize;
            self.top5_correct += ranked.iter().take(5).any(|&c| c == truth) as usize;
            self.confusion[truth * self.classes + ranked[0]] += 1;
        }
    }

    pub fn top1(&self) -> f64 {
        self.top1_correct as f64 / self.examples.max(1) as f64
    }

    pub fn top5(&self) -> f64 {
        self.top5_correct as f64 / self.examples.max(1) as f64
    }

    /// For each class: its examples and the fraction of them classified as it (None without
    /// examples).
    pub fn per_class(&self) -> Vec<(u64, Option<f64>)> {
        (0..self.classes)
            .map(|c| {
                let row = &self.confusion[c * self.classes..(c + 1) * self.classes];
                let total: u64 = row.iter().sum();
                (total, (total > 0).then(|| row[c] as f64 / total as f64))
            })
            .collect()
    }
}

/// Class indices from the highest logit down; equal logits keep index order.
pub fn ranking(logits: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order
}

/// The probabilities of `logits` (a softmax in f64).
/// The first row of `logits` (rows of `classes`) holding a value that is not finite, and that
/// value: a model whose weights overflow gives no ranking and no probability.
pub fn non_finite_row(logits: &[f32], classes: usize) -> Option<(usize, f32)> {
    logits
        .chunks(classes.max(1))
        .enumerate()
        .find_map(|(row, values)| values.iter().find(|v| !v.is_finite()).map(|&value| (row, value)))
}

pub fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let exps: Vec<f64> = logits.iter().map(|&v| (v as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_top1_top5_and_the_confusion_matrix() {
        let mut s = Scores::new(6);
        // Example 0: class 2 ranked first; example 1: class 5 ranked fourth; example 2: class 0
        // ranked last.
        let logits = [
            0.1, 0.2, 0.9, 0.3, 0.0, -1.0, //
            0.6, 0.5, 0.4, 0.0, 0.1, 0.3, //
            -3.0, 0.5, 0.4, 0.2, 0.1, 0.3,
        ];
        s.add(&logits, &[2, 5, 0]);
        assert_eq!((s.examples, s.top1_correct, s.top5_correct), (3, 1, 2));
        assert_eq!(s.confusion[2 * 6 + 2], 1);
        assert_eq!(s.confusion[5 * 6], 1);
        assert_eq!(s.confusion[1], 1);
        assert!((s.top1() - 1.0 / 3.0).abs() < 1e-12 && (s.top5() - 2.0 / 3.0).abs() < 1e-12);
        let per_class = s.per_class();
        assert_eq!(per_class[2], (1, Some(1.0)));
        assert_eq!(per_class[0], (1, Some(0.0)));
        assert_eq!(per_class[1], (0, None));
    }

    #[test]
    fn ties_rank_by_index_and_softmax_sums_to_one() {
        assert_eq!(ranking(&[1.0, 3.0, 3.0, -1.0]), [1, 2, 0, 3]);
        let p = softmax(&[1000.0, 1000.0, 0.0]);
        assert!((p[0] - 0.5).abs() < 1e-12 && p[2] < 1e-300 && p.iter().all(|v| v.is_finite()));
    }
}
