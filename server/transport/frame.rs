//! Length-prefixed JSON frames on the control connection (small and rare: handshakes and step
//! descriptors).

use std::io::{Error, ErrorKind, Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

const MAX_FRAME: usize = 1 << 20;

pub fn send<M: Serialize>(w: &mut impl Write, msg: &M) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()
}

pub fn recv<M: DeserializeOwned>(r: &mut impl Read) -> std::io::Result<M> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("control frame of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| Error::new(ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::Order;
    use crate::step::StepDesc;

    #[test]
    fn frames_round_trip_and_garbage_is_rejected() {
        let msg = Order::Step(StepDesc {
            step: 9,
            layer: 1,
            tokens: 33,
            cell: 1,
            client_routing: true,
            input: crate::dtype::Dtype::F16,
            output: crate::dtype::Dtype::Bf16,
            homes: vec![30, 0, 3],
            placement: 0,
            lost: Vec::new(),
        });
        let mut buf = Vec::new();
        send(&mut buf, &msg).unwrap();
        send(&mut buf, &Order::Shutdown).unwrap();
        let mut r = &buf[..];
        assert_eq!(recv::<Order>(&mut r).unwrap(), msg);
        assert_eq!(recv::<Order>(&mut r).unwrap(), Order::Shutdown);
        assert!(recv::<Order>(&mut r).is_err());
        let mut bad = &[0xffu8, 0xff, 0xff, 0xff][..];
        assert_eq!(
            recv::<Order>(&mut bad).unwrap_err().kind(),
            ErrorKind::InvalidData
        );
    }
}
