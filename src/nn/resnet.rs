//! ResNet-50 with torchvision's layout and parameter names (`torchvision.models.resnet50`):
//! bottleneck blocks with the stride on the 3x3 conv, 1x1-conv + BN downsampling, convs drawn
//! kaiming normal (fan_out, ReLU), BN weights ones and biases zeros, `fc` a default Linear.

use super::conv::{conv2d_bias_act, AdaptiveAvgPool2d, Conv2d, Conv2dArgs, MaxPool2d};
use super::{init, BatchNorm2d, Linear, Module, Sequential};
use crate::{no_grad, Device, Result, Tensor};

fn conv(cin: usize, cout: usize, k: usize, stride: usize, padding: usize, dev: &Device) -> Result<Conv2d> {
    let args = Conv2dArgs { stride: (stride, stride), padding: (padding, padding), ..Default::default() };
    let c = Conv2d::with_options(cin, cout, (k, k), args, false, dev)?;
    no_grad(|| c.weight.copy_(&init::kaiming_normal_fan_out(c.weight.shape(), dev)?))?;
    Ok(c)
}

/// `bn(conv(x))`, plus `residual`, then ReLU where asked. In evaluation mode one convolution
/// with its epilogue (`conv2d_bias_act`: the batch norm folded into the convolution's weight and
/// bias, which a compiled program computes once until a parameter changes); in training the
/// batch norm normalises by the batch's statistics, so the ops stay apart.
fn conv_bn(conv: &Conv2d, bn: &BatchNorm2d, x: &Tensor, residual: Option<&Tensor>, relu: bool) -> Result<Tensor> {
    if !bn.is_training() {
        let (w, b) = super::batchnorm::fold(conv, bn)?;
        return conv2d_bias_act(x, &w, &b, residual, conv.args, relu);
    }
    let mut y = bn.forward(&conv.forward(x)?)?;
    if let Some(r) = residual {
        y = y.add(r)?;
    }
    if relu {
        y.relu()
    } else {
        Ok(y)
    }
}

/// torchvision's downsampling path: a strided 1x1 convolution and its batch norm (children
/// `0` and `1`, as its `Sequential`).
pub struct Downsample {
    pub conv: Conv2d,
    pub bn: BatchNorm2d,
}

impl Module for Downsample {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        conv_bn(&self.conv, &self.bn, x, None, false)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("0".into(), &self.conv), ("1".into(), &self.bn)]
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.conv.visit_tensors_mut(f)?;
        self.bn.visit_tensors_mut(f)
    }
}

/// torchvision's `Bottleneck`: 1x1 -> 3x3 (stride) -> 1x1 (x4 channels), each with BN, plus
/// the identity or `downsample`, then ReLU.
pub struct Bottleneck {
    pub conv1: Conv2d,
    pub bn1: BatchNorm2d,
    pub conv2: Conv2d,
    pub bn2: BatchNorm2d,
    pub conv3: Conv2d,
    pub bn3: BatchNorm2d,
    pub downsample: Option<Downsample>,
}

impl Bottleneck {
    pub const EXPANSION: usize = 4;

    /// A block from `inplanes` channels to `planes * 4`; a downsample path is added when the
    /// stride or the channel count changes, as torchvision's `_make_layer`.
    pub fn new(inplanes: usize, planes: usize, stride: usize, dev: &Device) -> Result<Bottleneck> {
        let out = planes * Self::EXPANSION;
        let downsample = if stride != 1 || inplanes != out {
            Some(Downsample { conv: conv(inplanes, out, 1, stride, 0, dev)?, bn: BatchNorm2d::new(out, dev)? })
        } else {
            None
        };
        Ok(Bottleneck {
            conv1: conv(inplanes, planes, 1, 1, 0, dev)?,
            bn1: BatchNorm2d::new(planes, dev)?,
            conv2: conv(planes, planes, 3, stride, 1, dev)?,
            bn2: BatchNorm2d::new(planes, dev)?,
            conv3: conv(planes, out, 1, 1, 0, dev)?,
            bn3: BatchNorm2d::new(out, dev)?,
            downsample,
        })
    }
}

impl Module for Bottleneck {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let out = conv_bn(&self.conv1, &self.bn1, x, None, true)?;
        let out = conv_bn(&self.conv2, &self.bn2, &out, None, true)?;
        let identity = match &self.downsample {
            Some(d) => d.forward(x)?,
            None => x.clone(),
        };
        conv_bn(&self.conv3, &self.bn3, &out, Some(&identity), true)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = vec![
            ("conv1".into(), &self.conv1),
            ("bn1".into(), &self.bn1),
            ("conv2".into(), &self.conv2),
            ("bn2".into(), &self.bn2),
            ("conv3".into(), &self.conv3),
            ("bn3".into(), &self.bn3),
        ];
        if let Some(d) = &self.downsample {
            c.push(("downsample".into(), d));
        }
        c
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.conv1.visit_tensors_mut(f)?;
        self.bn1.visit_tensors_mut(f)?;
        self.conv2.visit_tensors_mut(f)?;
        self.bn2.visit_tensors_mut(f)?;
        self.conv3.visit_tensors_mut(f)?;
        self.bn3.visit_tensors_mut(f)?;
        match &mut self.downsample {
            Some(d) => d.visit_tensors_mut(f),
            None => Ok(()),
        }
    }
}

/// torchvision's `ResNet` with bottleneck blocks.
pub struct ResNet {
    pub conv1: Conv2d,
    pub bn1: BatchNorm2d,
    pub maxpool: MaxPool2d,
    pub layers: [Sequential; 4],
    pub avgpool: AdaptiveAvgPool2d,
    pub fc: Linear,
}

impl ResNet {
    /// `blocks[i]` bottlenecks in stage i (ResNet-50: [3, 4, 6, 3]).
    pub fn bottleneck(blocks: [usize; 4], num_classes: usize, dev: &Device) -> Result<ResNet> {
        let conv1 = conv(3, 64, 7, 2, 3, dev)?;
        let bn1 = BatchNorm2d::new(64, dev)?;
        let mut inplanes = 64;
        let mut stages = Vec::with_capacity(4);
        for (i, (&n, planes)) in blocks.iter().zip([64, 128, 256, 512]).enumerate() {
            let mut s = Sequential::new();
            for b in 0..n {
                let stride = if i > 0 && b == 0 { 2 } else { 1 };
                s = s.add(Bottleneck::new(inplanes, planes, stride, dev)?);
                inplanes = planes * Bottleneck::EXPANSION;
            }
            stages.push(s);
        }
        let layers: [Sequential; 4] = stages.try_into().unwrap_or_else(|_| unreachable!("four stages built above"));
        Ok(ResNet { conv1, bn1, maxpool: MaxPool2d::new(3, 2, 1), layers, avgpool: AdaptiveAvgPool2d((1, 1)), fc: Linear::new(inplanes, num_classes, dev)? })
    }
}

/// `torchvision.models.resnet50(num_classes=...)`, untrained.
pub fn resnet50(num_classes: usize, dev: &Device) -> Result<ResNet> {
    ResNet::bottleneck([3, 4, 6, 3], num_classes, dev)
}

impl Module for ResNet {
    /// `[N, 3, H, W]` images to `[N, num_classes]` logits.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let mut y = self.maxpool.forward(&conv_bn(&self.conv1, &self.bn1, x, None, true)?)?;
        for l in &self.layers {
            y = l.forward(&y)?;
        }
        self.fc.forward(&self.avgpool.forward(&y)?.flatten(1, -1)?)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = vec![("conv1".into(), &self.conv1), ("bn1".into(), &self.bn1)];
        for (i, l) in self.layers.iter().enumerate() {
            c.push((format!("layer{}", i + 1), l));
        }
        c.push(("fc".into(), &self.fc));
        c
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.conv1.visit_tensors_mut(f)?;
        self.bn1.visit_tensors_mut(f)?;
        for l in &mut self.layers {
            l.visit_tensors_mut(f)?;
        }
        self.fc.visit_tensors_mut(f)
    }
}
