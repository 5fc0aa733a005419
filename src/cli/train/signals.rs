//! SIGINT, SIGTERM and SIGHUP during a run: stop at the next point where what is kept can be
//! said.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use signal_hook::consts::{SIGINT, SIGTERM};

/// The signals that stop a run: SIGHUP too where there is one (not on Windows).
#[cfg(unix)]
const HANDLED: [i32; 3] = [SIGINT, SIGTERM, signal_hook::consts::SIGHUP];
#[cfg(not(unix))]
const HANDLED: [i32; 2] = [SIGINT, SIGTERM];

/// SIGINT, SIGTERM and SIGHUP (a closed terminal, a dropped ssh) during a run: the first asks it
/// to stop at the next point where it can say what is kept (after the step in flight, or
/// between an evaluation's batches), a second ends the process at once. Held for the whole run: unregistering leaves signal-hook's
/// handler in place, so a signal after a drop would be ignored, not given its default action.
pub struct StopSignals {
    /// Which signal asked the run to stop, or 0 while none has.
    stop: Arc<AtomicUsize>,
    handlers: Vec<signal_hook::SigId>,
}

impl StopSignals {
    pub fn register() -> Result<StopSignals, std::io::Error> {
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
        Ok(StopSignals { stop, handlers })
    }

    pub fn received(&self) -> usize {
        self.stop.load(Ordering::Relaxed)
    }

    /// The name of `signal`, one of those handled.
    pub fn name(signal: usize) -> &'static str {
        if signal == SIGINT as usize {
            "SIGINT"
        } else if signal == SIGTERM as usize {
            "SIGTERM"
        } else {
            "SIGHUP"
        }
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        for id in self.handlers.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}
