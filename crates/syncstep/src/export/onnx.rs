//! A ResNet's inference graph as an ONNX model: torchvision's forward in eval mode (BatchNorm
//! by its running statistics), on a float32 NCHW input whose batch is symbolic, to the logits.
//! The weights are the graph's initializers under their torchvision names, and the nodes are
//! named after torchvision's modules (`layer2.0.conv1`), so the graph reads as the model does.

use std::collections::BTreeMap;

use prost::Message;

use super::proto::{
    AttributeProto, Dimension, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
    StringStringEntryProto, TensorProto, TensorShapeProto, TensorType, TypeProto, ValueInfoProto,
    ATTRIBUTE_FLOAT, ATTRIBUTE_INT, ATTRIBUTE_INTS, FLOAT,
};
use crate::model::{BatchNorm, Conv, ResNet, TensorSpec, POOL_K, POOL_PAD, POOL_STRIDE};
use crate::step::BN_EPS;

/// The operator set the graph is written in: every operator it uses has had its present form
/// since, and onnxruntime and PyTorch's exporter both know it.
pub const OPSET: i64 = 17;

/// The IR version of opset 17's release (ONNX 1.12).
pub const IR_VERSION: i64 = 8;

/// The model's `producer_name`: what tells an ONNX file syncstep wrote.
pub const PRODUCER: &str = "syncstep";

/// The graph's input, float32 `[batch, 3, size, size]`, normalised as the run's images were.
pub const INPUT: &str = "input";

/// The graph's output, float32 `[batch, classes]`: the logits (before softmax).
pub const OUTPUT: &str = "logits";

/// The name of the input's and output's symbolic first dimension.
pub const BATCH: &str = "batch";

/// The ONNX model of `model` with `params` and `running` statistics (flat, in the model's
/// layout), for `size`×`size` images, with `metadata` as its metadata_props: its bytes.
pub fn model_bytes(
    model: &ResNet,
    (params, running): (&[f32], &[f32]),
    size: u32,
    metadata: &BTreeMap<String, String>,
) -> Vec<u8> {
    let mut initializer: Vec<TensorProto> =
        model.params.iter().map(|spec| tensor(spec, params)).collect();
    initializer.extend(model.buffers.iter().map(|spec| tensor(spec, running)));
    let graph = GraphProto {
        node: Graph::of(model).nodes,
        name: model.arch.to_string(),
        initializer,
        input: vec![value_info(INPUT, &[3, size as i64, size as i64])],
        output: vec![value_info(OUTPUT, &[model.classes as i64])],
    };
    let metadata_props = metadata
        .iter()
        .map(|(key, value)| StringStringEntryProto { key: key.clone(), value: value.clone() })
        .collect();
    ModelProto { graph: Some(graph), metadata_props, ..header() }.encode_to_vec()
}

/// The fields every model syncstep writes starts with: its IR version, producer and operator
/// set (written first, in tag order, so that the start of a file tells whose it is).
fn header() -> ModelProto {
    ModelProto {
        ir_version: IR_VERSION,
        producer_name: PRODUCER.into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        doc_string: String::new(),
        graph: None,
        opset_import: vec![OperatorSetIdProto { domain: String::new(), version: OPSET }],
        metadata_props: Vec::new(),
    }
}

/// The bytes every ONNX file syncstep writes begins with.
pub fn signature() -> Vec<u8> {
    ModelProto { ir_version: IR_VERSION, producer_name: PRODUCER.into(), ..ModelProto::default() }
        .encode_to_vec()
}

/// The tensor `spec` of `flat` as an initializer.
fn tensor(spec: &TensorSpec, flat: &[f32]) -> TensorProto {
    TensorProto {
        dims: spec.shape.iter().map(|&d| d as i64).collect(),
        data_type: FLOAT,
        name: spec.name.clone(),
        raw_data: flat[spec.range()].iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// A float32 tensor `[batch, dims…]`.
fn value_info(name: &str, dims: &[i64]) -> ValueInfoProto {
    let batch = Dimension { dim_value: None, dim_param: Some(BATCH.into()) };
    let fixed = dims.iter().map(|&d| Dimension { dim_value: Some(d), dim_param: None });
    let shape = TensorShapeProto { dim: std::iter::once(batch).chain(fixed).collect() };
    let tensor_type = TensorType { elem_type: FLOAT, shape: Some(shape) };
    ValueInfoProto { name: name.into(), r#type: Some(TypeProto { tensor_type: Some(tensor_type) }) }
}

/// An attribute `name` of `r#type`, its value still to be set.
fn attribute(name: &str, r#type: i32) -> AttributeProto {
    AttributeProto { name: name.into(), r#type, ..AttributeProto::default() }
}

fn ints(name: &str, values: &[i64]) -> AttributeProto {
    AttributeProto { ints: values.to_vec(), ..attribute(name, ATTRIBUTE_INTS) }
}

fn int(name: &str, i: i64) -> AttributeProto {
    AttributeProto { i, ..attribute(name, ATTRIBUTE_INT) }
}

fn float(name: &str, f: f32) -> AttributeProto {
    AttributeProto { f, ..attribute(name, ATTRIBUTE_FLOAT) }
}

/// The nodes of a model's forward, each output named as its node.
struct Graph<'a> {
    model: &'a ResNet,
    nodes: Vec<NodeProto>,
}

impl<'a> Graph<'a> {
    /// torchvision's `ResNet.forward`: the stem, the blocks, global average pool, fc.
    fn of(model: &'a ResNet) -> Graph<'a> {
        let mut g = Graph { model, nodes: Vec::new() };
        let x = g.conv(INPUT.into(), &model.stem_conv);
        let x = g.batchnorm(x, &model.stem_bn);
        let x = g.node("Relu", "relu", vec![x], vec![]);
        let k = POOL_K as i64;
        let (stride, pad) = (POOL_STRIDE as i64, POOL_PAD as i64);
        let pool = vec![ints("kernel_shape", &[k, k]), ints("strides", &[stride, stride])];
        let pads = ints("pads", &[pad; 4]);
        let mut x = g.node("MaxPool", "maxpool", vec![x], [pool, vec![pads]].concat());
        for block in &model.blocks {
            x = g.block(x, block);
        }
        let x = g.node("GlobalAveragePool", "avgpool", vec![x], vec![]);
        let x = g.node("Flatten", "flatten", vec![x], vec![int("axis", 1)]);
        let fc = [model.fc_weight, model.fc_bias].map(|i| model.params[i].name.clone());
        let inputs = vec![x, fc[0].clone(), fc[1].clone()];
        g.nodes.push(NodeProto {
            input: inputs,
            output: vec![OUTPUT.into()],
            name: "fc".into(),
            op_type: "Gemm".into(),
            attribute: vec![int("transB", 1)],
        });
        g
    }

    /// Adds the node `name` of `op` on `inputs`; its output's name.
    fn node(
        &mut self,
        op: &str,
        name: &str,
        inputs: Vec<String>,
        attribute: Vec<AttributeProto>,
    ) -> String {
        self.nodes.push(NodeProto {
            input: inputs,
            output: vec![name.into()],
            name: name.into(),
            op_type: op.into(),
            attribute,
        });
        name.into()
    }

    /// A residual block: its main path, each BN but the last followed by a ReLU, added to the
    /// shortcut (the input, or its projection) and then the block's ReLU.
    fn block(&mut self, input: String, block: &crate::model::Block) -> String {
        let mut x = input.clone();
        let last = block.units.len() - 1;
        for (j, (conv, bn)) in block.units.iter().enumerate() {
            x = self.conv(x, conv);
            x = self.batchnorm(x, bn);
            if j < last {
                x = self.node("Relu", &format!("{x}.relu"), vec![x.clone()], vec![]);
            }
        }
        let shortcut = match &block.downsample {
            Some((conv, bn)) => {
                let projected = self.conv(input, conv);
                self.batchnorm(projected, bn)
            }
            None => input,
        };
        let name = self.model.conv_name(&block.units[0].0).trim_end_matches(".conv1").to_string();
        let sum = self.node("Add", &format!("{name}.add"), vec![x, shortcut], vec![]);
        self.node("Relu", &format!("{name}.relu"), vec![sum], vec![])
    }

    fn conv(&mut self, x: String, conv: &Conv) -> String {
        let (k, s, p) = (conv.k as i64, conv.stride as i64, conv.pad as i64);
        let attributes = vec![
            ints("kernel_shape", &[k, k]),
            ints("strides", &[s, s]),
            ints("pads", &[p; 4]),
            ints("dilations", &[1, 1]),
            int("group", 1),
        ];
        let name = self.model.conv_name(conv).to_string();
        let weight = self.model.params[conv.weight].name.clone();
        self.node("Conv", &name, vec![x, weight], attributes)
    }

    fn batchnorm(&mut self, x: String, bn: &BatchNorm) -> String {
        let m = self.model;
        let inputs = [
            &m.params[bn.weight],
            &m.params[bn.bias],
            &m.buffers[bn.running_mean],
            &m.buffers[bn.running_var],
        ]
        .map(|spec| spec.name.clone());
        let name = inputs[0].trim_end_matches(".weight").to_string();
        let epsilon = vec![float("epsilon", BN_EPS)];
        self.node("BatchNormalization", &name, [vec![x], inputs.to_vec()].concat(), epsilon)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    /// Every node reads only what the graph's input, its initializers or an earlier node
    /// gives, every name is given once, and the last node gives the output.
    #[test]
    fn the_graph_is_in_order_and_names_each_value_once() {
        for arch in Arch::ALL {
            let model = ResNet::new(arch, 10).unwrap();
            let params = model.init_params(1);
            let bytes = model_bytes(&model, (&params, &model.init_buffers()), 32, &BTreeMap::new());
            assert!(bytes.starts_with(&signature()), "{arch}");
            let onnx = ModelProto::decode(&bytes[..]).unwrap();
            assert_eq!(onnx.opset_import[0].version, OPSET);
            let graph = onnx.graph.unwrap();
            let mut known: std::collections::HashSet<String> =
                graph.initializer.iter().map(|t| t.name.clone()).collect();
            assert_eq!(known.len(), model.params.len() + model.buffers.len(), "{arch}");
            known.insert(INPUT.into());
            for node in &graph.node {
                for input in &node.input {
                    assert!(
                        known.contains(input),
                        "{arch}: {} reads {input} before it is made",
                        node.name
                    );
                }
                for output in &node.output {
                    assert!(known.insert(output.clone()), "{arch}: {output} is made twice");
                }
            }
            assert_eq!(graph.node.last().unwrap().output, [OUTPUT]);
            let convs = graph.node.iter().filter(|n| n.op_type == "Conv").count();
            assert_eq!(convs, model.convs().len(), "{arch}");
            let bns = graph.node.iter().filter(|n| n.op_type == "BatchNormalization").count();
            assert_eq!(bns, model.batchnorms().len(), "{arch}");
        }
    }
}
