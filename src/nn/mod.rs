//! Neural-network building blocks. `functional` holds the composite ops (softmax, layer norm,
//! losses, convolution, pooling, ...), written as decompositions into primitives so the
//! compiler sees through them; `Module` and the layers build models from them.

mod attention;
mod batchnorm;
mod conv;
mod ddp;
pub mod functional;
pub mod init;
mod layers;
mod module;
mod resnet;
pub mod safetensors;
mod transformer;

pub use attention::{AttnArgs, MultiheadAttention};
pub use batchnorm::{fuse_conv_bn_eval, BatchNorm2d};
pub use ddp::{CommHook, DdpOptions, DistributedDataParallel};
pub use conv::{AdaptiveAvgPool2d, AvgPool2d, Conv2d, Conv2dArgs, Flatten, MaxPool2d, MaxPool2dArgs};
pub use layers::{Dropout, Embedding, LayerNorm, Linear, ReLU, Sequential, SiLU, Sigmoid, Tanh, GELUTanh, GELU};
pub use module::Module;
pub use resnet::{resnet50, Bottleneck, Downsample, ResNet};
pub use transformer::{
    generate_square_subsequent_mask, Activation, Transformer, TransformerConfig, TransformerDecoder, TransformerDecoderLayer, TransformerEncoder,
    TransformerEncoderLayer, TransformerMasks,
};
