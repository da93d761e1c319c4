//! Fault injection: scripted answer sequences fed to the sans-IO exchange (no socket), and the socket
//! driver's deadlines against a kernel that never answers.

use super::error::{DumpFault, NetlinkError, Request};
use super::exchange::{Exchange, Expect, Outcome, Progress};
use super::socket::oversized;
use super::{NLMSG_DONE, NLMSG_ERROR, NLM_F_REQUEST};

const PORT: u32 = 7;
const EPERM: i32 = libc::EPERM;
const EINVAL: i32 = libc::EINVAL;

fn header(len: usize, msg_type: u16, flags: u16, seq: u32, pid: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(&(len as u32).to_ne_bytes());
    b.extend_from_slice(&msg_type.to_ne_bytes());
    b.extend_from_slice(&flags.to_ne_bytes());
    b.extend_from_slice(&seq.to_ne_bytes());
    b.extend_from_slice(&pid.to_ne_bytes());
    b
}

/// An NLMSG_ERROR as the kernel sends it with capped acks: code, the echoed request header, and the
/// extended-ack message attribute when there is text.
fn nlerr(seq: u32, pid: u32, errno: i32, text: Option<&str>) -> Vec<u8> {
    let mut body = (-errno).to_ne_bytes().to_vec();
    body.extend(header(16, 0x0a00, NLM_F_REQUEST, seq, pid));
    let mut flags = 0x100; // NLM_F_CAPPED
    if let Some(t) = text {
        flags |= 0x200; // NLM_F_ACK_TLVS
        let mut s = t.as_bytes().to_vec();
        s.push(0);
        body.extend(((4 + s.len()) as u16).to_ne_bytes());
        body.extend(1u16.to_ne_bytes());
        body.extend(&s);
        body.resize(super::align4(body.len()), 0);
    }
    let mut m = header(16 + body.len(), NLMSG_ERROR, flags, seq, pid);
    m.extend(body);
    m
}

fn ack(seq: u32, pid: u32) -> Vec<u8> {
    nlerr(seq, pid, 0, None)
}

fn data(seq: u32, pid: u32, flags: u16) -> Vec<u8> {
    let mut m = header(20, 0x0a01, flags | 0x2, seq, pid);
    m.extend([2, 0, 0, 0]);
    m
}

fn done(seq: u32, pid: u32, errno: i32, flags: u16) -> Vec<u8> {
    let mut m = header(20, NLMSG_DONE, flags | 0x2, seq, pid);
    m.extend((-errno).to_ne_bytes());
    m
}

fn batch() -> Exchange {
    let expect = Expect::Acks {
        first: 100,
        last: 104,
        ack: 103,
        batch_begin: Some(100),
    };
    Exchange::new(request(100), expect, PORT)
}

fn dump() -> Exchange {
    Exchange::new(request(200), Expect::Answer { seq: 200 }, PORT)
}

fn request(seq: u32) -> Request {
    Request {
        what: "test".into(),
        seq,
    }
}

/// Feeds the datagrams in order, as long as the exchange wants more; returns the data messages seen.
fn feed(ex: &mut Exchange, datagrams: &[Vec<u8>]) -> Result<usize, NetlinkError> {
    let mut seen = 0;
    for d in datagrams {
        if ex.progress() == Progress::Complete {
            break;
        }
        ex.feed(d, &mut |_, _| seen += 1)?;
    }
    Ok(seen)
}

fn refused_seqs(outcome: Outcome) -> Vec<u32> {
    match outcome {
        Outcome::Acked(errors) => errors
            .iter()
            .map(|e| match e {
                NetlinkError::Kernel { seq, .. } => *seq,
                other => panic!("not a kernel error: {other}"),
            })
            .collect(),
        other => panic!("not acks: {other:?}"),
    }
}

#[test]
fn a_batch_ends_at_the_acknowledged_message() {
    let mut ex = batch();
    feed(&mut ex, &[ack(103, PORT)]).unwrap();
    assert_eq!(ex.progress(), Progress::Draining);
    assert!(refused_seqs(ex.finish().unwrap()).is_empty());
}

#[test]
fn an_object_error_is_kept_with_its_sequence_number() {
    let mut ex = batch();
    let datagram = [nlerr(101, PORT, EINVAL, Some("bad set")), ack(103, PORT)].concat();
    feed(&mut ex, &[datagram]).unwrap();
    assert_eq!(refused_seqs(ex.finish().unwrap()), vec![101]);
}

#[test]
fn an_error_that_aborts_the_batch_before_the_acknowledged_message_ends_it() {
    let mut ex = batch();
    feed(&mut ex, &[nlerr(101, PORT, libc::ENOMEM, None)]).unwrap();
    assert_eq!(ex.progress(), Progress::Draining, "no ACK will come");
    assert_eq!(refused_seqs(ex.finish().unwrap()), vec![101]);
}

#[test]
fn out_of_order_errors_after_the_ack_still_count() {
    let mut ex = batch();
    feed(&mut ex, &[ack(103, PORT), nlerr(102, PORT, EINVAL, None)]).unwrap();
    assert_eq!(ex.progress(), Progress::Draining);
    assert_eq!(refused_seqs(ex.finish().unwrap()), vec![102]);
}

#[test]
fn duplicated_answers_are_discarded() {
    let mut ex = batch();
    let e = nlerr(101, PORT, EINVAL, None);
    feed(&mut ex, &[e.clone(), e, ack(103, PORT), ack(103, PORT)]).unwrap();
    assert_eq!(ex.discarded, 2);
    assert_eq!(refused_seqs(ex.finish().unwrap()), vec![101]);
}

#[test]
fn stale_and_foreign_acks_are_never_taken_as_the_answer() {
    let mut ex = batch();
    // An earlier request's ACK left queued, an ACK for our sequence number but another port, a dump's
    // DONE from before: none of them ends the batch.
    let stale = [ack(99, PORT), ack(103, PORT + 1), done(50, PORT, 0, 0)];
    feed(&mut ex, &stale).unwrap();
    assert_eq!(ex.progress(), Progress::Waiting);
    assert_eq!(ex.discarded, 3);
    // Never answered: the driver's deadline ends it, and finish says so.
    assert!(matches!(ex.finish(), Err(NetlinkError::Protocol { .. })));

    let mut ex = batch();
    feed(&mut ex, &[ack(99, PORT), ack(103, PORT)]).unwrap();
    assert!(refused_seqs(ex.finish().unwrap()).is_empty());
}

#[test]
fn an_error_on_begin_only_refuses_the_whole_batch() {
    let mut ex = batch();
    feed(&mut ex, &[nlerr(100, PORT, EPERM, Some("no permission"))]).unwrap();
    assert_eq!(ex.progress(), Progress::Complete);
    let e = ex.finish().unwrap_err();
    assert!(
        matches!(
            e,
            NetlinkError::Batch {
                seq: 100,
                errno: EPERM,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.ext_ack(), Some("no permission"));
    let text = e.to_string();
    assert!(
        text.contains("whole batch") && text.contains("BATCH_BEGIN"),
        "{text}"
    );
    assert!(!e.breaks_socket(), "a refusal leaves the socket clean");
}

#[test]
fn answers_after_the_end_of_a_refused_batch_are_discarded() {
    let mut ex = batch();
    ex.feed(
        &[nlerr(100, PORT, EPERM, None), ack(103, PORT)].concat(),
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(ex.discarded, 1);
    assert!(matches!(ex.finish(), Err(NetlinkError::Batch { .. })));
}

#[test]
fn a_dump_collects_until_its_own_done() {
    let mut ex = dump();
    // A stale DONE of an earlier dump comes first: it must not end this one with an empty answer.
    let seen = feed(
        &mut ex,
        &[
            done(199, PORT, 0, 0),
            [data(200, PORT, 0), data(200, PORT, 0)].concat(),
            done(200, PORT, 0, 0),
        ],
    )
    .unwrap();
    assert_eq!(seen, 2);
    assert_eq!(ex.discarded, 1);
    assert!(matches!(ex.finish().unwrap(), Outcome::Answered));
}

#[test]
fn done_carrying_an_error_asks_for_a_retry() {
    let mut ex = dump();
    feed(
        &mut ex,
        &[data(200, PORT, 0), done(200, PORT, libc::EBUSY, 0)],
    )
    .unwrap();
    match ex.finish().unwrap() {
        Outcome::Faulty(DumpFault::DoneError { errno, .. }) => assert_eq!(errno, libc::EBUSY),
        other => panic!("{other:?}"),
    }
}

#[test]
fn dump_intr_asks_for_a_retry() {
    let mut ex = dump();
    let intr = super::exchange::NLM_F_DUMP_INTR;
    feed(
        &mut ex,
        &[
            data(200, PORT, 0),
            data(200, PORT, intr),
            done(200, PORT, 0, 0),
        ],
    )
    .unwrap();
    assert!(matches!(
        ex.finish().unwrap(),
        Outcome::Faulty(DumpFault::Interrupted)
    ));
}

#[test]
fn an_error_answering_a_dump_ends_it() {
    let mut ex = dump();
    feed(&mut ex, &[nlerr(200, PORT, EPERM, Some("denied"))]).unwrap();
    let e = ex.finish().unwrap_err();
    assert!(
        matches!(e, NetlinkError::Refused { errno: EPERM, .. }),
        "{e:?}"
    );
    assert!(e.needs_new_credentials() && !e.breaks_socket());
    let text = e.to_string();
    assert!(
        text.starts_with("test (seq 200): ") && text.ends_with(": denied"),
        "{text}"
    );
}

#[test]
fn a_get_with_ack_ends_at_the_ack() {
    let mut ex = dump();
    feed(&mut ex, &[[data(200, PORT, 0), ack(200, PORT)].concat()]).unwrap();
    assert_eq!(ex.progress(), Progress::Complete);
    assert!(matches!(ex.finish().unwrap(), Outcome::Answered));
}

#[test]
fn truncated_messages_are_protocol_errors() {
    // A message whose length runs past the end of the datagram.
    let mut cut = ack(103, PORT);
    cut.truncate(cut.len() - 4);
    let e = batch().feed(&cut, &mut |_, _| {}).unwrap_err();
    assert!(
        matches!(e, NetlinkError::Protocol { .. }) && e.breaks_socket(),
        "{e}"
    );
    // A whole message followed by half a header.
    let mut tail = ack(103, PORT);
    tail.extend([0u8; 8]);
    assert!(batch().feed(&tail, &mut |_, _| {}).is_err());
    // An NLMSG_ERROR too short to hold a code and the echoed header.
    let short = [header(20, NLMSG_ERROR, 0, 103, PORT), vec![0; 4]].concat();
    assert!(batch().feed(&short, &mut |_, _| {}).is_err());
    // A header that claims less than a header.
    let tiny = header(8, NLMSG_ERROR, 0, 103, PORT);
    let mut tiny = tiny;
    tiny.resize(16, 0);
    assert!(batch().feed(&tiny, &mut |_, _| {}).is_err());
}

#[test]
fn oversized_datagrams_are_errors_not_cut_answers() {
    // A message claiming more bytes than the datagram holds.
    let mut big = data(200, PORT, 0);
    big[0..4].copy_from_slice(&70_000u32.to_ne_bytes());
    assert!(dump().feed(&big, &mut |_, _| {}).is_err());
    // A datagram longer than the receive buffer (what recv reports with MSG_TRUNC).
    let e = oversized(200_000, 131_072).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    assert_eq!(oversized(4096, 131_072).unwrap(), 4096);
}
