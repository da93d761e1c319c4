//! nf_tables netlink numbers (linux/netfilter/nf_tables.h, nfnetlink.h, nf_nat.h).
#![allow(dead_code)]

/// The nf_tables subsystem of nfnetlink.
pub(crate) const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// Opens a batch (a transaction).
pub(crate) const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
/// Closes a batch: the kernel commits it.
pub(crate) const NFNL_MSG_BATCH_END: u16 = 0x11;
/// BATCH_BEGIN's attribute: the ruleset generation the batch was planned from (u32, big-endian).
pub(crate) const NFNL_BATCH_GENID: u16 = 1;
/// The multicast group of nf_tables events.
pub(crate) const NFNLGRP_NFTABLES: u32 = 7;

/// Message: create (or, as an event, created) a table.
pub(crate) const NFT_MSG_NEWTABLE: u16 = 0;
/// Message: get or dump a table.
pub(crate) const NFT_MSG_GETTABLE: u16 = 1;
/// Message: delete (or, as an event, deleted) a table.
pub(crate) const NFT_MSG_DELTABLE: u16 = 2;
/// Message: create (or, as an event, created) a chain.
pub(crate) const NFT_MSG_NEWCHAIN: u16 = 3;
/// Message: get or dump a chain.
pub(crate) const NFT_MSG_GETCHAIN: u16 = 4;
/// Message: delete (or, as an event, deleted) a chain.
pub(crate) const NFT_MSG_DELCHAIN: u16 = 5;
/// Message: create (or, as an event, created) a rule.
pub(crate) const NFT_MSG_NEWRULE: u16 = 6;
/// Message: get or dump a rule.
pub(crate) const NFT_MSG_GETRULE: u16 = 7;
/// Message: delete (or, as an event, deleted) a rule.
pub(crate) const NFT_MSG_DELRULE: u16 = 8;
/// Message: create (or, as an event, created) a set.
pub(crate) const NFT_MSG_NEWSET: u16 = 9;
/// Message: get or dump a set.
pub(crate) const NFT_MSG_GETSET: u16 = 10;
/// Message: delete (or, as an event, deleted) a set.
pub(crate) const NFT_MSG_DELSET: u16 = 11;
/// Message: create (or, as an event, created) set elements.
pub(crate) const NFT_MSG_NEWSETELEM: u16 = 12;
/// Message: get or dump set elements.
pub(crate) const NFT_MSG_GETSETELEM: u16 = 13;
/// Message: delete (or, as an event, deleted) set elements.
pub(crate) const NFT_MSG_DELSETELEM: u16 = 14;
/// Message: a new generation (after a transaction's events; also the answer to GETGEN).
pub(crate) const NFT_MSG_NEWGEN: u16 = 15;
/// Message: get the ruleset's generation id.
pub(crate) const NFT_MSG_GETGEN: u16 = 16;

/// Table attribute: its name.
pub(crate) const NFTA_TABLE_NAME: u16 = 1;
/// Table attribute: flags.
pub(crate) const NFTA_TABLE_FLAGS: u16 = 2;
/// Table flag (`enum nft_table_flags`): the table's base chains are unhooked (`flags dormant`).
pub(crate) const NFT_TABLE_F_DORMANT: u32 = 0x1;

/// Chain attribute: its table.
pub(crate) const NFTA_CHAIN_TABLE: u16 = 1;
/// Chain attribute: its name.
pub(crate) const NFTA_CHAIN_NAME: u16 = 3;
/// Chain attribute: its hook.
pub(crate) const NFTA_CHAIN_HOOK: u16 = 4;
/// Chain attribute: its policy.
pub(crate) const NFTA_CHAIN_POLICY: u16 = 5;
/// Chain attribute: its type.
pub(crate) const NFTA_CHAIN_TYPE: u16 = 7;
/// Chain hook attribute: the hook number.
pub(crate) const NFTA_HOOK_HOOKNUM: u16 = 1;
/// Chain hook attribute: the priority.
pub(crate) const NFTA_HOOK_PRIORITY: u16 = 2;
/// Chain hook attribute: the device.
pub(crate) const NFTA_HOOK_DEV: u16 = 3;

/// Rule attribute: its table.
pub(crate) const NFTA_RULE_TABLE: u16 = 1;
/// Rule attribute: its chain.
pub(crate) const NFTA_RULE_CHAIN: u16 = 2;
/// Rule attribute: its handle.
pub(crate) const NFTA_RULE_HANDLE: u16 = 3;
/// Rule attribute: its expressions.
pub(crate) const NFTA_RULE_EXPRESSIONS: u16 = 4;
/// Rule attribute: user data (nftnl TLVs).
pub(crate) const NFTA_RULE_USERDATA: u16 = 7;
/// nftnl userdata TLV type of a rule comment.
pub(crate) const NFTNL_UDATA_RULE_COMMENT: u8 = 0;

/// xtables compat `match` expression attribute: the match's name ("comment", "conntrack"...).
pub(crate) const NFTA_MATCH_NAME: u16 = 1;
/// xtables compat `match` expression attribute: the match's own struct, as iptables wrote it.
pub(crate) const NFTA_MATCH_INFO: u16 = 3;

/// List attribute: one element.
pub(crate) const NFTA_LIST_ELEM: u16 = 1;
/// Expression attribute: its name.
pub(crate) const NFTA_EXPR_NAME: u16 = 1;
/// Expression attribute: the data.
pub(crate) const NFTA_EXPR_DATA: u16 = 2;

/// Data attribute: a value.
pub(crate) const NFTA_DATA_VALUE: u16 = 1;
/// Data attribute: verdict.
pub(crate) const NFTA_DATA_VERDICT: u16 = 2;
/// Verdict attribute: the verdict code.
pub(crate) const NFTA_VERDICT_CODE: u16 = 1;
/// Verdict attribute: its chain.
pub(crate) const NFTA_VERDICT_CHAIN: u16 = 2;
/// NFT_DATA_VERDICT: the data type of a verdict map.
pub(crate) const NFT_DATA_VERDICT: u32 = 0xffff_ff00;

/// Set attribute: its table.
pub(crate) const NFTA_SET_TABLE: u16 = 1;
/// Set attribute: its name.
pub(crate) const NFTA_SET_NAME: u16 = 2;
/// Set attribute: flags.
pub(crate) const NFTA_SET_FLAGS: u16 = 3;
/// Set attribute: the key type (nft datatype id).
pub(crate) const NFTA_SET_KEY_TYPE: u16 = 4;
/// Set attribute: the key length.
pub(crate) const NFTA_SET_KEY_LEN: u16 = 5;
/// Set attribute: the data type.
pub(crate) const NFTA_SET_DATA_TYPE: u16 = 6;
/// Set attribute: the data length.
pub(crate) const NFTA_SET_DATA_LEN: u16 = 7;
/// Set attribute: the id that names it within the batch.
pub(crate) const NFTA_SET_ID: u16 = 10;
/// Set attribute: the timeout.
pub(crate) const NFTA_SET_TIMEOUT: u16 = 11;
/// Set attribute: its description.
pub(crate) const NFTA_SET_DESC: u16 = 9;
/// Set description attribute: the most elements it holds.
pub(crate) const NFTA_SET_DESC_SIZE: u16 = 1;
/// Set attribute: user data (nftnl TLVs).
pub(crate) const NFTA_SET_USERDATA: u16 = 13;
/// Element list attribute: the id of a set created in the same batch.
pub(crate) const NFTA_SET_ELEM_LIST_SET_ID: u16 = 4;

/// Set flag (`enum nft_set_flags`): belongs to one rule.
pub(crate) const NFT_SET_ANONYMOUS: u32 = 0x1;
/// Set flag: its elements never change.
pub(crate) const NFT_SET_CONSTANT: u32 = 0x2;
/// Set flag: a map.
pub(crate) const NFT_SET_MAP: u32 = 0x8;
/// Set flag: its elements may expire.
pub(crate) const NFT_SET_TIMEOUT: u32 = 0x10;
/// Set flag: updated from the packet path (nft's `dynamic`).
pub(crate) const NFT_SET_EVAL: u32 = 0x20;

/// Element list attribute: its table.
pub(crate) const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
/// Element list attribute: the set.
pub(crate) const NFTA_SET_ELEM_LIST_SET: u16 = 2;
/// Element list attribute: the elements.
pub(crate) const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
/// Set element attribute: the key.
pub(crate) const NFTA_SET_ELEM_KEY: u16 = 1;
/// Set element attribute: the data.
pub(crate) const NFTA_SET_ELEM_DATA: u16 = 2;
/// Set element attribute: user data (nftnl TLVs).
pub(crate) const NFTA_SET_ELEM_USERDATA: u16 = 6;
/// In an element's user data (libnftnl's TLV): the comment, NUL-terminated.
pub(crate) const NFTNL_UDATA_SET_ELEM_COMMENT: u8 = 0;

/// Payload expression attribute: the destination register.
pub(crate) const NFTA_PAYLOAD_DREG: u16 = 1;
/// Payload expression attribute: the header.
pub(crate) const NFTA_PAYLOAD_BASE: u16 = 2;
/// Payload expression attribute: the offset.
pub(crate) const NFTA_PAYLOAD_OFFSET: u16 = 3;
/// Payload expression attribute: the length.
pub(crate) const NFTA_PAYLOAD_LEN: u16 = 4;

/// Meta expression attribute: the destination register.
pub(crate) const NFTA_META_DREG: u16 = 1;
/// Meta expression attribute: the key.
pub(crate) const NFTA_META_KEY: u16 = 2;
/// Meta expression attribute: the source register.
pub(crate) const NFTA_META_SREG: u16 = 3;

/// Cmp expression attribute: the source register.
pub(crate) const NFTA_CMP_SREG: u16 = 1;
/// Cmp expression attribute: the operator.
pub(crate) const NFTA_CMP_OP: u16 = 2;
/// Cmp expression attribute: the data.
pub(crate) const NFTA_CMP_DATA: u16 = 3;

/// Bitwise expression attribute: the source register.
pub(crate) const NFTA_BITWISE_SREG: u16 = 1;
/// Bitwise expression attribute: the destination register.
pub(crate) const NFTA_BITWISE_DREG: u16 = 2;
/// Bitwise expression attribute: the length.
pub(crate) const NFTA_BITWISE_LEN: u16 = 3;
/// Bitwise expression attribute: the mask.
pub(crate) const NFTA_BITWISE_MASK: u16 = 4;
/// Bitwise expression attribute: the xor.
pub(crate) const NFTA_BITWISE_XOR: u16 = 5;

/// Immediate expression attribute: the destination register.
pub(crate) const NFTA_IMMEDIATE_DREG: u16 = 1;
/// Immediate expression attribute: the data.
pub(crate) const NFTA_IMMEDIATE_DATA: u16 = 2;

/// Lookup expression attribute: the set.
pub(crate) const NFTA_LOOKUP_SET: u16 = 1;
/// Lookup expression attribute: the source register.
pub(crate) const NFTA_LOOKUP_SREG: u16 = 2;
/// Lookup expression attribute: the destination register.
pub(crate) const NFTA_LOOKUP_DREG: u16 = 3;
/// Lookup expression attribute: the id of a set created in the same batch.
pub(crate) const NFTA_LOOKUP_SET_ID: u16 = 4;
/// Lookup expression attribute: flags.
pub(crate) const NFTA_LOOKUP_FLAGS: u16 = 5;
/// Lookup flag: match when the key is not in the set.
pub(crate) const NFT_LOOKUP_F_INV: u32 = 1;

/// Numgen expression attribute: the destination register.
pub(crate) const NFTA_NG_DREG: u16 = 1;
/// Numgen expression attribute: the modulus.
pub(crate) const NFTA_NG_MODULUS: u16 = 2;
/// Numgen expression attribute: its type.
pub(crate) const NFTA_NG_TYPE: u16 = 3;
/// Numgen expression attribute: the offset.
pub(crate) const NFTA_NG_OFFSET: u16 = 4;
/// numgen type: incrementing.
pub(crate) const NFT_NG_INCREMENTAL: u32 = 0;
/// numgen type: random.
pub(crate) const NFT_NG_RANDOM: u32 = 1;

/// Dynset expression attribute: the set.
pub(crate) const NFTA_DYNSET_SET_NAME: u16 = 1;
/// Dynset expression attribute: the operator.
pub(crate) const NFTA_DYNSET_OP: u16 = 3;
/// Dynset expression attribute: the key register.
pub(crate) const NFTA_DYNSET_SREG_KEY: u16 = 4;
/// Dynset expression attribute: the data register.
pub(crate) const NFTA_DYNSET_SREG_DATA: u16 = 5;
/// Dynset expression attribute: the timeout.
pub(crate) const NFTA_DYNSET_TIMEOUT: u16 = 6;

/// Nat expression attribute: its type.
pub(crate) const NFTA_NAT_TYPE: u16 = 1;
/// Nat expression attribute: the address family.
pub(crate) const NFTA_NAT_FAMILY: u16 = 2;
/// Nat expression attribute: the address register.
pub(crate) const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
/// Nat expression attribute: the port register.
pub(crate) const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
/// Nat expression attribute: flags.
pub(crate) const NFTA_NAT_FLAGS: u16 = 7;

/// Masq expression attribute: flags.
pub(crate) const NFTA_MASQ_FLAGS: u16 = 1;

/// NAT range flag (linux/netfilter/nf_nat.h) of the nat, masq and redir expressions: an address is given.
pub(crate) const NF_NAT_RANGE_MAP_IPS: u32 = 1 << 0;
/// NAT range flag: a port is given.
pub(crate) const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 1 << 1;
/// NAT range flag: random ports (`random`).
pub(crate) const NF_NAT_RANGE_PROTO_RANDOM: u32 = 1 << 2;
/// NAT range flag: the same address for a client (`persistent`).
pub(crate) const NF_NAT_RANGE_PERSISTENT: u32 = 1 << 3;
/// NAT range flag: fully randomised ports (`fully-random`).
pub(crate) const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 1 << 4;

/// Redir expression attribute: the port register.
pub(crate) const NFTA_REDIR_REG_PROTO_MIN: u16 = 1;
/// Redir expression attribute: flags.
pub(crate) const NFTA_REDIR_FLAGS: u16 = 3;

/// Reject expression attribute: its type.
pub(crate) const NFTA_REJECT_TYPE: u16 = 1;
/// Reject expression attribute: the ICMP code.
pub(crate) const NFTA_REJECT_ICMP_CODE: u16 = 2;

/// Ct expression attribute: the destination register.
pub(crate) const NFTA_CT_DREG: u16 = 1;
/// Ct expression attribute: the key.
pub(crate) const NFTA_CT_KEY: u16 = 2;
/// Ct expression attribute: the direction.
pub(crate) const NFTA_CT_DIRECTION: u16 = 3;

/// Fib expression attribute: the destination register.
pub(crate) const NFTA_FIB_DREG: u16 = 1;
/// Fib expression attribute: what to return.
pub(crate) const NFTA_FIB_RESULT: u16 = 2;
/// Fib expression attribute: flags.
pub(crate) const NFTA_FIB_FLAGS: u16 = 3;
/// Fib flag (`enum nft_fib_flags`, named NFTA_ by the kernel): look up the source address.
pub(crate) const NFTA_FIB_F_SADDR: u32 = 1 << 0;
/// Fib flag: look up the destination address.
pub(crate) const NFTA_FIB_F_DADDR: u32 = 1 << 1;
/// Fib flag: include the packet mark.
pub(crate) const NFTA_FIB_F_MARK: u32 = 1 << 2;
/// Fib flag: include the input interface.
pub(crate) const NFTA_FIB_F_IIF: u32 = 1 << 3;
/// Fib flag: include the output interface.
pub(crate) const NFTA_FIB_F_OIF: u32 = 1 << 4;
/// Fib result (`enum nft_fib_result`): the output interface index.
pub(crate) const NFT_FIB_RESULT_OIF: u32 = 1;
/// Fib result: the output interface name.
pub(crate) const NFT_FIB_RESULT_OIFNAME: u32 = 2;
/// Fib result: the address type (RTN_*).
pub(crate) const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;

/// Counter expression attribute: bytes.
pub(crate) const NFTA_COUNTER_BYTES: u16 = 1;
/// Counter expression attribute: packets.
pub(crate) const NFTA_COUNTER_PACKETS: u16 = 2;

/// Generation attribute: the id that names it within the batch.
pub(crate) const NFTA_GEN_ID: u16 = 1;
