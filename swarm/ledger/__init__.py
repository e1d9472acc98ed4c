"""Evidence: each peer's signed, hash-chained ledger of what it did, and the receipts that witness it.

Owns the ledger file format and its checks (`chain`: one SQLite file per peer and run, entries
signed by the owner, :func:`verify_ledger`) and participation receipts (`receipts`: what a peer
signs about its part in a round, strict parsing, per-peer contributions, and the cross-check of a
receipt's ledger head against its signer's ledger). `python -m swarm.ledger verify|receipts|show`
inspects ledgers. Depends only on `bootstrap.identity` (signatures, peer IDs) and the standard library.
Exports: Ledger, LedgerEntry, LedgerError, LedgerVerdict, verify_ledger, read_entries, find_ledgers,
default_ledger_path, Receipt, SignedReceipt, ReceiptRejected, sign_receipt, verify_receipt,
Contribution, contributions, receipt_key, verified_receipts, cross_check, and the constants below.
"""

from swarm.ledger.chain import (
    DEFAULT_LEDGER_DIR,
    GENESIS,
    LEDGER_KIND,
    Ledger,
    LedgerEntry,
    LedgerError,
    LedgerVerdict,
    default_ledger_path,
    find_ledgers,
    read_entries,
    verify_ledger,
)
from swarm.ledger.receipts import (
    RECEIPT_KIND,
    Contribution,
    Receipt,
    ReceiptRejected,
    SignedReceipt,
    contributions,
    cross_check,
    receipt_key,
    sign_receipt,
    verified_receipts,
    verify_receipt,
)

__all__ = [
    "DEFAULT_LEDGER_DIR",
    "GENESIS",
    "LEDGER_KIND",
    "RECEIPT_KIND",
    "Contribution",
    "Ledger",
    "LedgerEntry",
    "LedgerError",
    "LedgerVerdict",
    "Receipt",
    "ReceiptRejected",
    "SignedReceipt",
    "contributions",
    "cross_check",
    "default_ledger_path",
    "find_ledgers",
    "read_entries",
    "receipt_key",
    "sign_receipt",
    "verified_receipts",
    "verify_ledger",
    "verify_receipt",
]
