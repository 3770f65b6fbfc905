use crate::common::*;
use kiln::prelude::*;

#[test]
fn smoke() {
    let a = t(&[1.0, -2.0, 3.0, -4.0, 5.0, -6.0], &[2, 3], DType::F32);
    let b = t(&[10.0, 20.0, 30.0], &[3], DType::F32);
    let c = (&a + &b).unwrap().relu().unwrap();
    assert_eq!(vals(&c), vec![11.0, 18.0, 33.0, 6.0, 25.0, 24.0]);
    let s = a.sum(&[1], false).unwrap();
    assert_eq!(vals(&s), vec![2.0, -5.0]);
    let m = a.t().unwrap().matmul(&a).unwrap();
    assert_eq!(m.shape(), &[3, 3]);
    let x = t(&host_rand(12, 1), &[3, 4], DType::F64);
    kiln::gradcheck(|xs| xs[0].transpose(0, 1)?.softmax(1)?.mul(&xs[0].t()?)?.sum(&[0], false), &[x], Default::default()).unwrap();
    let sm = a.softmax(1).unwrap();
    println!("{sm}");
    let (v, i) = a.max(1, false).unwrap();
    assert_eq!(vals(&v), vec![3.0, 5.0]);
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![2, 1]);
    let logits = t(&host_rand(12, 2), &[4, 3], DType::F32).requires_grad();
    let target = Tensor::from_vec(vec![0i64, 2, 1, -100], &[4], &dev()).unwrap();
    let loss = nn::functional::cross_entropy(&logits, &target).unwrap();
    loss.backward().unwrap();
    println!("{loss} {}", logits.grad().unwrap());
}
