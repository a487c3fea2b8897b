-- 0005: deliverability feedback. What the provider last reported for each sent email (polled by
-- the deliverability_feedback DAG: GET /emails/{id} -> last_event), so an email is re-polled a
-- bounded number of times and never after a final event. Suppressions themselves live in
-- mail.suppression (0001): one-click unsubscribes by user, bounces and complaints by address.
-- The poll's window over sent emails by sent_at uses send_log_sent_idx (0004); nothing here
-- depends on 0004 for correctness. Every timestamp is timestamptz (stored in UTC).

create table mail.delivery_status (
    send_log_id         bigint      primary key references mail.send_log (id),
    provider_message_id text        not null,
    last_event          text        not null,
    final               boolean     not null default false,
    checks              integer     not null default 1 check (checks >= 1),
    first_checked_at    timestamptz not null default now(),
    checked_at          timestamptz not null default now()
);
-- "Which non-final statuses are due for another look?" (the feedback poll's recheck branch).
create index delivery_status_recheck_idx on mail.delivery_status (checked_at) where not final;

comment on table mail.delivery_status is
    'What the email API last reported for a sent email (GET /emails/{id}), one row per send-log row; '
    'written by the deliverability_feedback DAG, which suppresses bounced and complained addresses.';
comment on column mail.delivery_status.send_log_id is 'The email (mail.send_log.id).';
comment on column mail.delivery_status.provider_message_id is 'The provider''s email id that was asked about.';
comment on column mail.delivery_status.last_event is
    'The provider''s last_event: delivered, bounced, complained, opened, clicked, delivery_delayed, failed, '
    'canceled, ... or not_found (the provider no longer knows the email).';
comment on column mail.delivery_status.final is
    'True after a final event (bounced, complained, failed, canceled, not_found): not polled again.';
comment on column mail.delivery_status.checks is 'How many times the status was asked for (bounded per email).';
comment on column mail.delivery_status.first_checked_at is 'First poll (timestamptz, UTC).';
comment on column mail.delivery_status.checked_at is 'Latest poll (timestamptz, UTC).';
