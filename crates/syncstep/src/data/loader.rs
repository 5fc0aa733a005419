//! The input pipeline: background threads decode and augment the batches of the next steps
//! while the GPU trains on the current one. Each batch is a function of its step alone (the
//! epoch's shuffle, and each image's augmentation seeded by (seed, epoch, example)), so the
//! number of threads and their timing never change what a step sees. Where there are no
//! threads (a browser), [`batch`] makes the same batches on the caller's.

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::schedule::Epochs;
use super::source::{Dataset, DatasetError};
use super::transform::{eval_image, example_rng, train_image, Augment, Normalization, Preprocess};
use super::Batch;
use crate::host::{format_bytes, ByteScale};

/// Which examples a batch holds and how its images are made.
#[derive(Clone, Copy, Debug)]
pub enum Plan {
    /// Step s trains on the s-th batch of the epochs' shuffles, augmented: its examples at
    /// positions `part.0 .. part.1` (a process's replicas' shards; `(0, batch)`: all of them).
    Train { epochs: Epochs, augment: Augment, part: (usize, usize) },
    /// Batch s holds examples s·batch … in order (the last one shorter), evaluation images
    /// made by `preprocess`.
    Eval { batch: usize, preprocess: Preprocess },
}

impl Plan {
    /// Batches a pass takes: unbounded for training, ⌈len/batch⌉ for evaluation.
    pub fn batches(&self, examples: usize) -> u64 {
        match *self {
            Plan::Train { .. } => u64::MAX,
            Plan::Eval { batch, .. } => examples.div_ceil(batch.max(1)) as u64,
        }
    }
}

type Made = (u64, Result<Batch, DatasetError>);

/// Each loader thread's stack (std's default, named so the address space it takes is known).
const THREAD_STACK: usize = 2 << 20;

/// What a thread maps beyond its stack: guard pages and the signal stack std gives it.
const THREAD_OVERHEAD: u64 = 64 << 10;

/// Address space kept under a limit (`ulimit -v`) for all but the loader's threads: batches,
/// image decoding, the driver's mappings.
const ADDRESS_SPACE_KEPT: u64 = 512 << 20;

/// Refuses `workers` threads whose stacks would not fit in the address space a limit leaves. The
/// system may start a thread whose signal stack it then cannot map, and that aborts the process,
/// so this is asked before any thread starts.
fn threads_fit(workers: usize, address_space_left: Option<u64>) -> Result<(), DatasetError> {
    let Some(left) = address_space_left else { return Ok(()) };
    let need = (workers as u64).saturating_mul(THREAD_STACK as u64 + THREAD_OVERHEAD);
    if need.saturating_add(ADDRESS_SPACE_KEPT) <= left {
        return Ok(());
    }
    Err(DatasetError::Threads {
        wanted: workers,
        started: 0,
        reason: format!(
            "their stacks need {} of the {} the address-space limit (ulimit -v) leaves",
            format_bytes(need, ByteScale::Fit),
            format_bytes(left, ByteScale::Fit)
        ),
    })
}

/// Batches in step order from `workers` threads, at most `prefetch` steps ahead.
pub struct Loader {
    requests: Option<Sender<u64>>,
    made: Receiver<Made>,
    ready: BTreeMap<u64, Result<Batch, DatasetError>>,
    next: u64,
    requested: u64,
    end: u64,
    prefetch: u64,
    threads: Vec<JoinHandle<()>>,
}

impl Loader {
    /// Starts the threads on the batches from `first` on. A thread the system will not start
    /// (a process limit, memory for its stack) is an error naming `--workers`; those started
    /// end when the error drops them.
    pub fn start(
        data: Arc<Dataset>,
        plan: Plan,
        size: u32,
        norm: Normalization,
        first: u64,
        workers: usize,
    ) -> Result<Loader, DatasetError> {
        threads_fit(workers.max(1), crate::host::address_space_left())?;
        let (requests, jobs) = mpsc::channel::<u64>();
        let (done, made) = mpsc::channel::<Made>();
        let jobs = Arc::new(Mutex::new(jobs));
        let threads = (0..workers.max(1))
            .map(|i| {
                let (jobs, done, data) = (jobs.clone(), done.clone(), data.clone());
                let thread = std::thread::Builder::new().name(format!("loader-{i}"));
                let thread = thread.stack_size(THREAD_STACK);
                let started = thread.spawn(move || {
                    let mut epoch_order: Option<(u64, Vec<usize>)> = None;
                    loop {
                        let job = jobs.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok(step) = job else { return };
                        let batch = make_batch(&data, &plan, size, &norm, step, &mut epoch_order);
                        if done.send((step, batch)).is_err() {
                            return;
                        }
                    }
                });
                started.map_err(|e| DatasetError::Threads {
                    wanted: workers,
                    started: i,
                    reason: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let prefetch = 2 * workers.max(1) as u64;
        let mut loader = Loader {
            requests: Some(requests),
            made,
            ready: BTreeMap::new(),
            next: first,
            requested: first,
            end: plan.batches(data.len()),
            prefetch,
            threads,
        };
        loader.request_ahead();
        Ok(loader)
    }

    fn request_ahead(&mut self) {
        let Some(requests) = &self.requests else { return };
        while self.requested < self.end && self.requested < self.next + self.prefetch {
            if requests.send(self.requested).is_err() {
                return;
            }
            self.requested += 1;
        }
    }

    /// The next batch in order and how long this call waited for it; None after the last.
    pub fn next_batch(&mut self) -> Option<(Result<Batch, DatasetError>, Duration)> {
        if self.next >= self.end {
            return None;
        }
        let start = Instant::now();
        let batch = loop {
            if let Some(batch) = self.ready.remove(&self.next) {
                break batch;
            }
            match self.made.recv() {
                Ok((step, batch)) => {
                    self.ready.insert(step, batch);
                }
                Err(_) => {
                    break Err(DatasetError::Worker("the loader's threads ended early".into()))
                }
            }
        };
        let waited = start.elapsed();
        self.next += 1;
        self.request_ahead();
        Some((batch, waited))
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // Closing the request channel ends each thread after its batch in hand.
        self.requests = None;
        while self.made.try_recv().is_ok() {}
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Batch `step` of `plan`, made on this thread.
pub fn batch(
    data: &Dataset,
    plan: &Plan,
    size: u32,
    norm: &Normalization,
    step: u64,
) -> Result<Batch, DatasetError> {
    make_batch(data, plan, size, norm, step, &mut None)
}

/// Batch `step` of `plan`; `epoch_order` keeps the thread's last epoch shuffle.
fn make_batch(
    data: &Dataset,
    plan: &Plan,
    size: u32,
    norm: &Normalization,
    step: u64,
    epoch_order: &mut Option<(u64, Vec<usize>)>,
) -> Result<Batch, DatasetError> {
    let (examples, epoch): (Vec<usize>, u64) = match *plan {
        Plan::Train { epochs, part, .. } => {
            let epoch = epochs.epoch_of(step);
            if epoch_order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                *epoch_order = Some((epoch, epochs.order(epoch)));
            }
            let order = &epoch_order.as_ref().map_or(&[][..], |(_, o)| o);
            let examples = epochs.examples_of(step, order);
            let part = examples.get(part.0..part.1).ok_or_else(|| {
                DatasetError::Worker(format!(
                    "examples {}..{} of a batch of {}: past its end",
                    part.0,
                    part.1,
                    examples.len()
                ))
            })?;
            (part.to_vec(), epoch)
        }
        Plan::Eval { batch, .. } => {
            let start = step as usize * batch;
            ((start..(start + batch).min(data.len())).collect(), 0)
        }
    };
    let image_len = 3 * size as usize * size as usize;
    let mut images =
        crate::host::vec_with_capacity(examples.len() * image_len, "a batch of decoded images")?;
    let mut labels = Vec::with_capacity(examples.len());
    for &i in &examples {
        let img = data.decode(i)?;
        let pixels = match *plan {
            Plan::Train { epochs, augment, .. } => {
                let mut rng = example_rng(epochs.seed, epoch, i as u64);
                train_image(&img, size, augment, &mut rng, norm)
            }
            Plan::Eval { preprocess, .. } => eval_image(&img, size, preprocess, norm),
        };
        images.extend(pixels);
        labels.push(data.label(i));
    }
    Ok(Batch { images, labels, h: size, w: size })
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::RgbImage;

    fn dataset(n: u32) -> Arc<Dataset> {
        let images = (0..n)
            .map(|i| {
                (
                    RgbImage::from_fn(20 + i, 24, |x, y| image::Rgb([x as u8, y as u8, i as u8])),
                    i % 3,
                )
            })
            .collect();
        Arc::new(Dataset::from_images(vec!["a".into(), "b".into(), "c".into()], images))
    }

    fn batches(
        data: &Arc<Dataset>,
        plan: Plan,
        first: u64,
        count: usize,
        workers: usize,
    ) -> Vec<Batch> {
        let mut loader =
            Loader::start(data.clone(), plan, 16, Normalization::IMAGENET, first, workers).unwrap();
        (0..count).map(|_| loader.next_batch().unwrap().0.unwrap()).collect()
    }

    #[test]
    fn batches_depend_on_the_step_alone() {
        let data = dataset(10);
        let epochs = Epochs { examples: 10, batch: 4, seed: 3 };
        let plan = Plan::Train { epochs, augment: Augment::CropFlip, part: (0, 4) };
        let one = batches(&data, plan, 0, 6, 1);
        assert_eq!(one, batches(&data, plan, 0, 6, 3));
        assert_eq!(one[3..], batches(&data, plan, 3, 3, 2)[..]);
        assert!(one.iter().all(|b| b.len() == 4 && b.images.len() == 4 * 3 * 16 * 16));
        // Steps 0 and 2 are the first of epochs 0 and 1: other shuffles, other augmentations.
        assert_ne!(one[0].images, one[2].images);
        // A process's part of each batch is those examples of the whole batch, made alike.
        let part_plan = Plan::Train { epochs, augment: Augment::CropFlip, part: (1, 3) };
        let part = batches(&data, part_plan, 0, 6, 2);
        for (whole, part) in one.iter().zip(&part) {
            assert_eq!(part.len(), 2);
            assert_eq!(
                part.images[..],
                whole.images[whole.images.len() / 4..][..part.images.len()]
            );
            assert_eq!(part.labels[..], whole.labels[1..3]);
        }
    }

    #[test]
    fn an_evaluation_pass_covers_every_example_once_in_order() {
        let data = dataset(7);
        let plan = Plan::Eval { batch: 3, preprocess: Preprocess::Torchvision };
        let mut loader =
            Loader::start(data.clone(), plan, 16, Normalization::IMAGENET, 0, 2).unwrap();
        let mut labels = Vec::new();
        while let Some((batch, _)) = loader.next_batch() {
            labels.extend(batch.unwrap().labels);
        }
        assert_eq!(labels, (0..7).map(|i| i % 3).collect::<Vec<u32>>());
    }

    #[test]
    fn threads_past_the_address_space_left_are_refused_before_any_starts() {
        assert!(threads_fit(1000, None).is_ok());
        assert!(threads_fit(4, Some(1 << 30)).is_ok());
        let e = threads_fit(1000, Some(2 << 30)).unwrap_err().to_string();
        assert!(e.contains("1000 loader threads (0 started"), "{e}");
        assert!(e.contains("ulimit -v") && e.ends_with("use a smaller --workers"), "{e}");
    }
}
