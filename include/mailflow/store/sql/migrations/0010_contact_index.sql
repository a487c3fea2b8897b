-- migrate: no-transaction
-- 0010 (the audience snapshot at 1M users): the contact probes of the audience snapshot and of the contact guard read a
-- user's contacts from one covering index, built CONCURRENTLY (no lock that blocks reads or writes
-- of mail.send_log; an interrupted build leaves an INVALID index that the next run drops and
-- rebuilds, mailflow.migrate).
--
-- A contact (docs/model.md, "The contact policy") is a sent, in-flight or planned row; the policy
-- needs its status, sent_at and planned time (coalesce(scheduled_at, minted_at)). 0001's
-- send_log_cooldown_idx (user_id, sent_at) on the same rows held only sent_at, so every probe
-- visited the heap. This index holds the rest too (INCLUDE), so the snapshot's one pass over its
-- candidates' contacts and contact.contacts_of are index-only scans; it then replaces 0001's
-- index (same rows, same key: the write path keeps the same number of indexes).
create index concurrently if not exists send_log_contact_idx on mail.send_log (user_id, sent_at)
    include (status, scheduled_at, minted_at) where status in ('pending', 'sending', 'sent');
drop index concurrently if exists mail.send_log_cooldown_idx;
