//! What the autotune's choices are keyed by: the adapter (as the cache file names it), the op
//! and the shape. A leaf: the tuner, its clock and its cache file all speak of these.

use std::collections::HashMap;

use crate::conv2d::{Conv2dAlgo, Conv2dOp, Conv2dShape};

/// What a choice is made for: (adapter, op, shape).
pub(super) type ChoiceKey = (String, Conv2dOp, Conv2dShape);

/// The variant chosen for each [`ChoiceKey`].
pub(super) type Choices = HashMap<ChoiceKey, Conv2dAlgo>;

/// An adapter as the choice cache knows it: the same hardware and driver choose alike. One line
/// without tabs, as the cache file stores it.
pub(super) fn adapter_key(info: &wgpu::AdapterInfo) -> String {
    let key = format!("{:?}|{}|{}|{}", info.backend, info.name, info.driver, info.driver_info);
    key.replace(|c: char| c.is_control(), " ")
}

pub(super) fn is_cpu(info: &wgpu::AdapterInfo) -> bool {
    info.device_type == wgpu::DeviceType::Cpu
}
