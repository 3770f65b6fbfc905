//! Datasets and the loader (host-side; batches move to the test device with to_device_async).

use crate::common::*;
use kiln::data::{DataLoader, Dataset, Mnist, SyntheticClassification};
use kiln::prelude::*;

/// Sample i is the tensor [i] with target i.
struct Counting(usize);
impl Dataset for Counting {
    fn len(&self) -> usize {
        self.0
    }
    fn get(&self, i: usize) -> kiln::Result<(Tensor, Tensor)> {
        Ok((Tensor::from_vec(vec![i as f32], &[1], &Device::Cpu)?, Tensor::from_vec(vec![i as i64], &[], &Device::Cpu)?))
    }
}

fn epoch_targets(l: &DataLoader<Counting>) -> Vec<Vec<i64>> {
    l.iter().map(|b| b.unwrap().1.to_vec::<i64>().unwrap()).collect()
}

#[test]
fn shuffled_order_is_deterministic_per_seed_and_covers_every_sample_once() {
    let a = DataLoader::new(Counting(103), 10).unwrap().shuffle(42);
    let b = DataLoader::new(Counting(103), 10).unwrap().shuffle(42).workers(4).prefetch(3);
    let c = DataLoader::new(Counting(103), 10).unwrap().shuffle(43);
    let (a1, b1, c1) = (epoch_targets(&a), epoch_targets(&b), epoch_targets(&c));
    assert_eq!(a1, b1, "same seed, same order, whatever the worker count");
    assert_ne!(a1, c1, "another seed, another order");
    assert_eq!(a1.len(), 11);
    assert_eq!(a1.iter().map(|b| b.len()).collect::<Vec<_>>(), [vec![10; 10], vec![3]].concat());
    let mut all: Vec<i64> = a1.concat();
    assert_ne!(all, (0..103).collect::<Vec<i64>>(), "shuffled");
    all.sort_unstable();
    assert_eq!(all, (0..103).collect::<Vec<i64>>(), "every sample exactly once");
    let a2 = epoch_targets(&a);
    assert_ne!(a1, a2, "each epoch reshuffles");
    assert_eq!(a2, epoch_targets(&b), "epoch by epoch");
}

#[test]
fn batches_stack_samples_in_order_and_drop_last_works() {
    let l = DataLoader::new(Counting(7), 3).unwrap().drop_last(true).workers(3);
    assert_eq!(l.len(), 2);
    let batches: Vec<(Tensor, Tensor)> = l.iter().map(|b| b.unwrap()).collect();
    assert_eq!(batches.len(), 2);
    assert_eq!(batches[0].0.shape(), &[3, 1]);
    assert_eq!(batches[1].1.to_vec::<i64>().unwrap(), vec![3, 4, 5]);
    let d = dev();
    let x = batches[1].0.to_device_async(&d).unwrap();
    assert_eq!(vals(&x), vec![3.0, 4.0, 5.0]);
    assert!(DataLoader::new(Counting(3), 0).is_err());
}

#[test]
fn synthetic_samples_are_pure_functions_of_seed_and_index() {
    let s = SyntheticClassification::mnist_like(50, 1).unwrap();
    let (x1, y1) = s.get(7).unwrap();
    let (x2, y2) = s.get(7).unwrap();
    assert_eq!(x1.to_vec::<f32>().unwrap(), x2.to_vec::<f32>().unwrap());
    assert_eq!(y1.item::<i64>().unwrap(), y2.item::<i64>().unwrap());
    assert_eq!(x1.shape(), &[784]);
    let labels: Vec<i64> = (0..50).map(|i| s.get(i).unwrap().1.item::<i64>().unwrap()).collect();
    assert!(labels.iter().all(|&l| (0..10).contains(&l)));
    assert!(labels.iter().collect::<std::collections::HashSet<_>>().len() >= 5, "several classes occur");
    assert!(s.get(50).is_err());
    assert!(SyntheticClassification::new(5, 0, 3, 0).is_err());
}

fn idx_file(name: &str, magic: u32, dims: &[u32], data: &[u8]) -> String {
    let path = std::env::temp_dir().join(format!("kiln-{}-{name}", std::process::id())).to_string_lossy().into_owned();
    let mut b = magic.to_be_bytes().to_vec();
    for d in dims {
        b.extend(d.to_be_bytes());
    }
    b.extend_from_slice(data);
    std::fs::write(&path, b).unwrap();
    path
}

#[test]
fn idx_files_read_and_reject_bad_ones() {
    let pixels: Vec<u8> = (0..12).map(|i| (i * 20) as u8).collect();
    let imgs = idx_file("imgs", 0x0803, &[2, 2, 3], &pixels);
    let labs = idx_file("labs", 0x0801, &[2], &[7, 3]);
    let m = Mnist::from_idx(&imgs, &labs).unwrap();
    assert_eq!(m.len(), 2);
    let (x, y) = m.get(1).unwrap();
    assert_eq!(y.item::<i64>().unwrap(), 3);
    assert_close(&vals(&x), &pixels[6..].iter().map(|&p| p as f64 / 255.0).collect::<Vec<_>>(), 1e-7, 1e-7);
    let bad_magic = idx_file("bad", 0x0D03, &[2, 2, 3], &pixels);
    let e = Mnist::from_idx(&bad_magic, &labs).err().expect("bad magic is an error");
    assert!(matches!(e, kiln::Error::Io { .. }) && e.to_string().contains("magic"), "{e}");
    let short = idx_file("short", 0x0803, &[2, 2, 3], &pixels[..11]);
    assert!(Mnist::from_idx(&short, &labs).err().expect("short file").to_string().contains("need 12 bytes"));
    let three = idx_file("three", 0x0801, &[3], &[1, 2, 3]);
    assert!(Mnist::from_idx(&imgs, &three).err().expect("label count").to_string().contains("3 labels for 2 images"));
    for p in [imgs, labs, bad_magic, short, three] {
        let _ = std::fs::remove_file(p);
    }
}
