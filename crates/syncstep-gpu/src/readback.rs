//! Reading buffers back to the host: copies to MAP_READ staging recorded into an encoder, and
//! the awaited map, which natively waits in the device's poll and in a browser never blocks.

use super::{Encoder, Gpu, GpuError, Result, Slice};

impl Gpu {
    /// Copies a slice back to the host. Awaits the map without blocking (works in a browser).
    pub async fn read<T: bytemuck::Pod>(&self, s: Slice<'_>) -> Result<Vec<T>> {
        let mut encoder = self.encoder();
        let readback = self.record_read(&mut encoder, &[s]);
        self.submit(encoder).await?;
        readback.read(self).await
    }

    /// Records into `encoder` copies of `slices`, one after the other, to one MAP_READ staging
    /// buffer; once the encoder is submitted, [`Readback::read`] returns them. Reading what a
    /// submission computes as part of it saves a second submission, and one staging buffer one
    /// map: a data-parallel step reads several BN sites' rows at once.
    pub fn record_read(&self, encoder: &mut Encoder, slices: &[Slice<'_>]) -> Readback {
        let bytes: u64 = slices.iter().map(Slice::bytes).sum();
        let staging = (bytes > 0).then(|| {
            let staging = self.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size: bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut at = 0;
            for s in slices.iter().filter(|s| s.len > 0) {
                encoder.copy_buffer_to_buffer(s.buffer, s.offset, &staging, at, s.bytes());
                at += s.bytes();
            }
            staging
        });
        Readback { staging }
    }

    pub async fn read_f32(&self, s: Slice<'_>) -> Result<Vec<f32>> {
        self.read(s).await
    }

    /// Maps all of `buffer` for `mode` and awaits the map, which completes once the submission
    /// `after` (the last to use the buffer; `None`: the latest) is done. Natively the device's
    /// poll waits for that submission and runs the map's callback, here or on a helper thread
    /// (see [`Gpu::blocking_maps`]); in a browser the browser does, without blocking.
    pub async fn map(
        &self,
        buffer: &wgpu::Buffer,
        mode: wgpu::MapMode,
        after: Option<wgpu::SubmissionIndex>,
    ) -> Result<()> {
        let (tx, rx) = futures::channel::oneshot::channel();
        buffer.slice(..).map_async(mode, move |r| {
            let _ = tx.send(r.map_err(|e| GpuError::Readback(e.to_string())));
        });
        #[cfg(not(target_arch = "wasm32"))]
        let rx = {
            // A failed poll (device lost) may never run the callback: its error comes instead.
            let (lost_tx, lost_rx) = futures::channel::oneshot::channel();
            let device = self.device.clone();
            let wait = move || {
                if let Err(e) =
                    device.poll(wgpu::PollType::Wait { submission_index: after, timeout: None })
                {
                    let _ = lost_tx.send(Err(GpuError::DeviceLost(e.to_string())));
                }
            };
            if self.blocking_maps {
                wait();
            } else {
                std::thread::spawn(wait);
            }
            // After a poll that succeeded only the callback decides: another thread's poll may
            // be the one running it, a moment after this poll returned.
            let lost = Box::pin(async move {
                match lost_rx.await {
                    Ok(lost) => Ok(lost),
                    Err(_) => futures::future::pending().await,
                }
            });
            async move {
                match futures::future::select(rx, lost).await {
                    futures::future::Either::Left((r, _))
                    | futures::future::Either::Right((r, _)) => r,
                }
            }
        };
        #[cfg(target_arch = "wasm32")]
        let _ = after; // the browser polls on its own
        let mapped = rx.await;
        self.check()?; // a lost device is the cause of a dropped callback
        mapped.map_err(|_| GpuError::Readback("the map callback was dropped".into()))?
    }
}

/// Copies recorded by [`Gpu::record_read`], readable once their encoder is submitted.
#[must_use = "recorded copies are read with `read`"]
pub struct Readback {
    /// `None` when there is nothing to copy.
    staging: Option<wgpu::Buffer>,
}

impl Readback {
    /// Awaits the latest submission on `gpu` (which must include the recorded copies) and
    /// returns the slices' contents, one after the other.
    pub async fn read<T: bytemuck::Pod>(self, gpu: &Gpu) -> Result<Vec<T>> {
        let Some(staging) = self.staging else { return Ok(Vec::new()) };
        gpu.map(&staging, wgpu::MapMode::Read, None).await?;
        let view =
            staging.slice(..).get_mapped_range().map_err(|e| GpuError::Readback(e.to_string()))?;
        let values = bytemuck::cast_slice::<u8, T>(&view);
        let mut data = syncstep_host::vec_with_capacity(values.len(), "reading a buffer back")?;
        data.extend_from_slice(values);
        drop(view);
        staging.unmap();
        Ok(data)
    }
}
