//! SIGINT, SIGTERM and SIGHUP during a run: stop at the next point where what is kept can be
//! said. Under `mpirun`, also the SIGCONT with which Open MPI starts to end a job.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
#[cfg(unix)]
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGINT, SIGTERM};

/// The signals that stop a run: SIGHUP too where there is one (not on Windows).
#[cfg(unix)]
const HANDLED: [i32; 3] = [SIGINT, SIGTERM, signal_hook::consts::SIGHUP];
#[cfg(not(unix))]
const HANDLED: [i32; 2] = [SIGINT, SIGTERM];

/// SIGINT, SIGTERM and SIGHUP (a closed terminal, a dropped ssh) during a run: the first asks it
/// to stop at the next point where it can say what is kept (after the step in flight, or
/// between an evaluation's batches), a second ends the process at once. Under `mpirun`,
/// mpirun's SIGCONT ([`MPIRUN_ENDING`]) asks it to stop too, and the SIGTERM that follows it is
/// still a first (rank 0 may be writing the checkpoint). Held for the whole run: unregistering
/// leaves signal-hook's handler in place, so a signal after a drop would be ignored, not given
/// its default action.
pub struct StopSignals {
    /// Which signal asked the run to stop, or 0 while none has.
    stop: Arc<AtomicUsize>,
    handlers: Vec<signal_hook::SigId>,
    /// Under `mpirun`: ends the thread that tells mpirun's SIGCONT from a resume's.
    watch: Option<Arc<AtomicBool>>,
}

impl StopSignals {
    /// The handlers of a run; `mpirun`: this process is a rank, and mpirun's SIGCONT (see
    /// [`MPIRUN_ENDING`]) stops it too.
    pub fn register(mpirun: bool) -> Result<StopSignals, std::io::Error> {
        let stop = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(AtomicBool::new(false));
        let mut handlers = Vec::new();
        for signal in HANDLED {
            // Handlers run in the order registered: a second signal, while the step in flight
            // finishes, finds `seen` set and ends the process at once.
            handlers.push(signal_hook::flag::register_conditional_shutdown(
                signal,
                128 + signal,
                seen.clone(),
            )?);
            handlers.push(signal_hook::flag::register(signal, seen.clone())?);
            handlers.push(signal_hook::flag::register_usize(
                signal,
                stop.clone(),
                signal as usize,
            )?);
        }
        let watch = match mpirun {
            true => watch_mpirun(&stop, &mut handlers)?,
            false => None,
        };
        Ok(StopSignals { stop, handlers, watch })
    }

    pub fn received(&self) -> usize {
        self.stop.load(Ordering::Relaxed)
    }

    /// What stopped the run, for its last line: the name of `signal`, one of those handled.
    pub fn name(signal: usize) -> &'static str {
        match signal as i32 {
            SIGINT => "SIGINT",
            SIGTERM => "SIGTERM",
            MPIRUN_ENDING => "mpirun is ending the job (its SIGCONT)",
            _ => "SIGHUP",
        }
    }

    /// Whether `signal` says that `mpirun` is ending the job.
    pub fn job_ending(signal: usize) -> bool {
        signal as i32 == MPIRUN_ENDING
    }

    /// The exit status of a run `signal` stopped: the shell's status of a process the signal
    /// ended, 128 + its number (mpirun's SIGCONT's as the SIGTERM that follows it).
    pub fn exit_code(signal: usize) -> u8 {
        match signal as i32 {
            MPIRUN_ENDING => 128 + SIGTERM as u8,
            signal => 128 + signal as u8,
        }
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        for id in self.handlers.drain(..) {
            signal_hook::low_level::unregister(id);
        }
        if let Some(quit) = self.watch.take() {
            quit.store(true, Ordering::Relaxed);
        }
    }
}

/// Open MPI (4.1) ends a job, on a Ctrl-C or SIGTERM to `mpirun`, by sending each rank SIGCONT
/// (to wake a stopped one), then SIGTERM `odls_base_sigkill_timeout` seconds later, then
/// SIGKILL as long after that: the SIGCONT is the first word a rank has, and its whole time. A
/// SIGCONT also resumes a rank that was stopped (mpirun passes a suspended job's SIGTSTP on as
/// SIGSTOP, and its SIGCONT as is); that one is no reason to stop.
#[cfg(unix)]
const MPIRUN_ENDING: i32 = signal_hook::consts::SIGCONT;
/// No SIGCONT where there is none: no number a signal has.
#[cfg(not(unix))]
const MPIRUN_ENDING: i32 = -1;

/// How often the watch thread wakes, and the gap in its wakes that says the process was stopped
/// (or starved of the processor for as long, when the SIGCONT is let pass: the SIGTERM that
/// follows it stops the run instead).
#[cfg(unix)]
const TICK: Duration = Duration::from_millis(100);
#[cfg(unix)]
const STALL: Duration = Duration::from_secs(1);

/// Under `mpirun`: the handler of SIGCONT and the thread that turns mpirun's into a stop of
/// the run ([`watch_continued`]); what ends the thread.
#[cfg(unix)]
fn watch_mpirun(
    stop: &Arc<AtomicUsize>,
    handlers: &mut Vec<signal_hook::SigId>,
) -> Result<Option<Arc<AtomicBool>>, std::io::Error> {
    let continued = Arc::new(AtomicBool::new(false));
    handlers.push(signal_hook::flag::register(MPIRUN_ENDING, continued.clone())?);
    let (stop, quit) = (stop.clone(), Arc::new(AtomicBool::new(false)));
    let quit_watch = quit.clone();
    std::thread::Builder::new()
        .name("mpirun-watch".into())
        .spawn(move || watch_continued(&continued, &stop, &quit_watch))?;
    Ok(Some(quit))
}

/// No SIGCONT to watch for.
#[cfg(not(unix))]
fn watch_mpirun(
    _stop: &Arc<AtomicUsize>,
    _handlers: &mut Vec<signal_hook::SigId>,
) -> Result<Option<Arc<AtomicBool>>, std::io::Error> {
    Ok(None)
}

/// Until `quit`: turns each SIGCONT (`continued`) into a stop (`stop`, unless one was asked
/// already), except one that came as a stall of this thread's wakes ended: a stopped
/// process's resume. A stopped process's threads all stop, this one with them, and whether it
/// or the handler runs first on the resume, the stall's end is seen within [`STALL`] of the
/// signal.
#[cfg(unix)]
fn watch_continued(continued: &AtomicBool, stop: &AtomicUsize, quit: &AtomicBool) {
    let (mut last, mut resumed) = (Instant::now(), None::<Instant>);
    while !quit.load(Ordering::Relaxed) {
        std::thread::sleep(TICK);
        let now = Instant::now();
        if now - last > STALL {
            resumed = Some(now);
        }
        last = now;
        let resume = resumed.is_some_and(|at| now - at <= STALL);
        if continued.swap(false, Ordering::Relaxed) && !resume {
            let code = MPIRUN_ENDING as usize;
            let _ = stop.compare_exchange(0, code, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}
