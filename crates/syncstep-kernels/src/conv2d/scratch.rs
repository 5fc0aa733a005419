//! The convolutions' scratch slots: each names one buffer a device keeps and reuses
//! ([`Gpu::scratch`](syncstep_gpu::Gpu::scratch)). Launches run one after another, so variants
//! that never run inside one another share a slot: Winograd keeps its transforms in the GEMMs'
//! im2col slot and its products in a weight gradient's, and adds no memory of its own.

use syncstep_gpu::ScratchSlot;

/// An im2col chunk of the GEMMs; Winograd's transformed weights and input.
pub(super) const IM2COL: ScratchSlot = ScratchSlot("conv2d im2col");
/// The Blocked and Winograd weight gradients' pairwise sums; the Winograd forward's products.
pub(super) const WEIGHT_SUMS: ScratchSlot = ScratchSlot("conv2d weight sums");
/// The Winograd weight gradient's products.
pub(super) const WEIGHT_UNITS: ScratchSlot = ScratchSlot("conv2d weight units");
/// The weights laid out in rows for the register tiles' GEMMs.
pub(super) const WEIGHT_ROWS: ScratchSlot = ScratchSlot("conv2d weight rows");
/// The taps a cropped kernel keeps.
pub(super) const KEPT_TAPS: ScratchSlot = ScratchSlot("conv2d kept taps");
/// The implicit-GEMM family's weights laid out for its gather GEMM.
pub(super) const IMPLICIT_WEIGHT_ROWS: ScratchSlot = ScratchSlot("conv2d implicit weight rows");
/// The implicit-GEMM family's segment sums (slabs), added in order by one pass.
pub(super) const IMPLICIT_SEGMENT_SUMS: ScratchSlot = ScratchSlot("conv2d implicit segment sums");
/// The implicit-GEMM weight gradient's node sums, combined by one fixed tree.
pub(super) const IMPLICIT_NODE_SUMS: ScratchSlot = ScratchSlot("conv2d implicit node sums");
