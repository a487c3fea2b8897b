-- 0019: the provider's outcomes pushed as signed webhooks (Resend: Svix scheme), kept durably and applied to
-- the send log whatever order they arrive in.
--
-- mail.webhook_event is the receiver's inbox: a verified webhook is inserted (ON CONFLICT on svix_id does
-- nothing: the provider delivers at least once) and committed before the receiver answers 2xx, so an
-- acknowledged event is never lost. Applying it to the send log happens in the same transaction when its email
-- is known, or later by a sweep (an event can arrive before the batch answer that stores its email id).
-- mail.delivery_event keeps every outcome of an email as a typed event (webhook or poll); mail.delivery_status
-- gains one column per outcome, each written with least(), and an outcome chosen by precedence, never by
-- arrival order. Every timestamp is timestamptz (stored in UTC).
create table if not exists mail.webhook_event (
    svix_id             text        primary key,
    event_type          text        not null,
    provider_message_id text,
    occurred_at         timestamptz,
    received_at         timestamptz not null default now(),
    payload             jsonb       not null,
    applied_at          timestamptz,
    attempts            integer     not null default 0 check (attempts >= 0),
    decision            text,
    alerted_at          timestamptz,
    constraint webhook_event_applied_has_decision check (applied_at is null or decision is not null)
);
-- "Which events still wait for their email?" (the sweep): fewest attempts first, then the oldest.
create index if not exists webhook_event_pending_idx on mail.webhook_event (attempts, received_at)
    where applied_at is null;
-- "Which decisions must a person see?" (mismatches and failures not alerted yet).
create index if not exists webhook_event_alert_idx on mail.webhook_event (received_at)
    where alerted_at is null and decision in ('recipient_mismatch', 'failed', 'unknown_email');

comment on table mail.webhook_event is
    'Every verified provider webhook, one row per svix-id (the provider''s message id, stable across its '
    'retries), committed before the receiver answered 2xx. applied_at is null until the event was applied to '
    'the send log or decided unmatched.';
comment on column mail.webhook_event.svix_id is 'The svix-id header: the dedupe key of at-least-once delivery.';
comment on column mail.webhook_event.event_type is 'The envelope''s type: email.sent, email.delivered, email.bounced, ...';
comment on column mail.webhook_event.provider_message_id is 'data.email_id: the provider''s email id (null for non-email events).';
comment on column mail.webhook_event.occurred_at is 'The envelope''s created_at: when the provider saw the event (its clock).';
comment on column mail.webhook_event.received_at is 'When the receiver committed the event (database clock).';
comment on column mail.webhook_event.payload is 'The verified envelope as received (JSON).';
comment on column mail.webhook_event.applied_at is 'When the event was applied to the send log or decided unmatched; null: waiting.';
comment on column mail.webhook_event.attempts is 'Apply attempts so far (an email id not in the send log yet is tried again).';
comment on column mail.webhook_event.decision is
    'What applying decided: applied, duplicate_outcome (the outcome was recorded before: nothing changed), '
    'unknown_email (no send-log row has the id, given up), recipient_mismatch (the provider''s recipient is not '
    'the row''s address: not applied to the row; the provider''s recipient is suppressed for a hard bounce or '
    'complaint), failed (the provider did not send it: recorded and alerted), ignored (an event type the send '
    'log does not track). Null while waiting.';
comment on column mail.webhook_event.alerted_at is
    'When a mismatch, failure or unknown email was put in an alert (null: not yet).';

create table if not exists mail.delivery_event (
    id                  bigint      generated always as identity primary key,
    send_log_id         bigint      not null references mail.send_log (id),
    provider_message_id text        not null,
    event               text        not null check (event in ('sent', 'delivered', 'delivery_delayed', 'bounced',
                                                              'complained', 'opened', 'clicked', 'failed',
                                                              'suppressed')),
    bounce_type         text        check (bounce_type is null or event = 'bounced'),
    occurred_at         timestamptz not null,
    recorded_at         timestamptz not null default now(),
    source              text        not null check (source in ('webhook', 'poll')),
    svix_id             text        unique,
    constraint delivery_event_webhook_has_svix_id check ((source = 'webhook') = (svix_id is not null))
);
create index if not exists delivery_event_send_log_idx on mail.delivery_event (send_log_id, occurred_at);

comment on table mail.delivery_event is
    'Every outcome the provider reported for a sent email, as a typed event: pushed (webhook, one per svix-id) '
    'or polled (GET /emails/{id}). Appended only.';
comment on column mail.delivery_event.id is 'Surrogate key, in order of recording.';
comment on column mail.delivery_event.send_log_id is 'The email (mail.send_log.id), matched by the provider''s email id.';
comment on column mail.delivery_event.provider_message_id is 'The provider''s email id the event is about.';
comment on column mail.delivery_event.event is
    'sent, delivered, delivery_delayed, bounced, complained, opened, clicked, failed or suppressed (the address '
    'is on the provider''s own suppression list).';
comment on column mail.delivery_event.bounce_type is
    'For bounced: Permanent (a hard bounce: the address is suppressed), Transient or Undetermined (soft: not '
    'suppressed). Null for other events and for a poll (Resend''s last_event bounced is permanent).';
comment on column mail.delivery_event.occurred_at is 'When the provider saw it (the event''s created_at; a poll: the time of the poll).';
comment on column mail.delivery_event.recorded_at is 'When it was recorded here (database clock).';
comment on column mail.delivery_event.source is 'webhook or poll.';
comment on column mail.delivery_event.svix_id is 'The webhook''s svix-id (mail.webhook_event); null for a poll.';

alter table mail.delivery_status
    add column if not exists delivered_at     timestamptz,
    add column if not exists hard_bounced_at  timestamptz,
    add column if not exists soft_bounced_at  timestamptz,
    add column if not exists complained_at    timestamptz,
    add column if not exists failed_at        timestamptz,
    add column if not exists delayed_at       timestamptz,
    add column if not exists suppressed_at    timestamptz,
    add column if not exists first_opened_at  timestamptz,
    add column if not exists first_clicked_at timestamptz,
    add column if not exists opens            integer not null default 0,
    add column if not exists clicks           integer not null default 0,
    add column if not exists outcome          text,
    add column if not exists outcome_at       timestamptz;
-- A row created by a webhook has never been polled: no poll count, no poll times.
alter table mail.delivery_status alter column checks set default 0;
alter table mail.delivery_status alter column first_checked_at drop not null;
alter table mail.delivery_status alter column checked_at drop not null;
alter table mail.delivery_status drop constraint if exists delivery_status_checks_check;
alter table mail.delivery_status drop constraint if exists delivery_status_checks_nonnegative;
alter table mail.delivery_status add constraint delivery_status_checks_nonnegative check (checks >= 0) not valid;
alter table mail.delivery_status drop constraint if exists delivery_status_outcome_known;
alter table mail.delivery_status add constraint delivery_status_outcome_known check (outcome is null or outcome in
    ('complained', 'hard_bounced', 'failed', 'delivered', 'soft_bounced', 'delayed', 'suppressed')) not valid;
-- "Which sent emails have no outcome yet?" (the safety-net poll).
create index if not exists delivery_status_no_outcome_idx on mail.delivery_status (send_log_id) where outcome is null;

comment on column mail.delivery_status.checks is 'How many times the status was polled (0: only webhooks reported on it).';
comment on column mail.delivery_status.last_event is
    'The poll''s last answer (GET /emails/{id} last_event: delivered, bounced, ..., not_found, or '
    'recipient_mismatch); ''webhook'' for a row only webhooks reported on. The outcome column is the '
    'order-independent one.';
comment on column mail.delivery_status.first_checked_at is 'First poll (timestamptz, UTC); null: never polled.';
comment on column mail.delivery_status.checked_at is 'Latest poll (timestamptz, UTC); null: never polled.';
comment on column mail.delivery_status.delivered_at is 'Earliest delivered (or implied by an open or click) time reported.';
comment on column mail.delivery_status.hard_bounced_at is 'Earliest permanent bounce reported: the address is suppressed.';
comment on column mail.delivery_status.soft_bounced_at is 'Earliest transient or undetermined bounce reported (not suppressed).';
comment on column mail.delivery_status.complained_at is 'Earliest spam complaint reported: the address is suppressed.';
comment on column mail.delivery_status.failed_at is 'Earliest failed reported (the provider did not send it; alerted, not suppressed).';
comment on column mail.delivery_status.delayed_at is 'Earliest delivery_delayed reported.';
comment on column mail.delivery_status.suppressed_at is 'Earliest report that the address is on the provider''s own suppression list.';
comment on column mail.delivery_status.first_opened_at is 'Earliest open reported.';
comment on column mail.delivery_status.first_clicked_at is 'Earliest click reported.';
comment on column mail.delivery_status.opens is 'Open events recorded (each webhook once).';
comment on column mail.delivery_status.clicks is 'Click events recorded (each webhook once).';
comment on column mail.delivery_status.outcome is
    'The email''s outcome by precedence, never by arrival order: complained > hard_bounced > suppressed > failed > '
    'delivered > soft_bounced > delayed; null: nothing reported yet.';
comment on column mail.delivery_status.outcome_at is 'When the outcome column last changed (database clock).';


-- The outcome of an email from its outcome columns, by precedence (never by arrival order): the one rule the
-- receiver, the poll and the analyst views share.
create or replace function mail.delivery_outcome(complained_at timestamptz, hard_bounced_at timestamptz,
                                                 suppressed_at timestamptz, failed_at timestamptz,
                                                 delivered_at timestamptz, soft_bounced_at timestamptz,
                                                 delayed_at timestamptz)
returns text language sql immutable parallel safe as $$
    select case when complained_at is not null then 'complained'
                when hard_bounced_at is not null then 'hard_bounced'
                when suppressed_at is not null then 'suppressed'
                when failed_at is not null then 'failed'
                when delivered_at is not null then 'delivered'
                when soft_bounced_at is not null then 'soft_bounced'
                when delayed_at is not null then 'delayed'
           end
$$;
comment on function mail.delivery_outcome(timestamptz, timestamptz, timestamptz, timestamptz, timestamptz,
                                          timestamptz, timestamptz) is
    'complained > hard_bounced > suppressed > failed > delivered > soft_bounced > delayed > null, from the '
    'delivery_status columns of the same names (complained_at, ...): mail.delivery_status.outcome.';
