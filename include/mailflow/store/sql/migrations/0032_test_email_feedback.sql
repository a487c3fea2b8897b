-- migrate: no-transaction
-- 0032: the provider's outcomes of test emails, matched and recorded instead of left pending.
--
-- A test email (provision_campaign's send_test_email) is recorded as the campaign event test_email and never
-- as a send-log row, so its webhooks matched no send-log row: they stayed pending, were swept for 72 hours and
-- were then decided unknown_email and alerted; its hard bounce or complaint suppressed nobody.
--
-- * mail.test_email: one row per test email, written before the request (status sending) with the tag id it
--   carries (the tag mailflow_test), then the provider's email id and the campaign event once accepted. The
--   receiver matches an event to it by the provider's email id or, before that id is stored (the webhook can
--   beat the answer), by the tag. Its outcome columns fold the events like mail.delivery_status.
-- * mail.test_email_event: every outcome reported for a test email (one per svix-id), like
--   mail.delivery_event for send-log rows.
-- * The backfill: every test_email campaign event recorded before this file becomes a mail.test_email row
--   (address null: the event kept the masked address only), and the inbox rows that were decided
--   unknown_email for its provider id are made pending again, so the sweep records them on it (and suppresses
--   a hard bounce or complaint). Their alerted_at is kept: nothing is alerted twice.
-- Run statement by statement outside a transaction: the new tables' foreign keys lock mail.campaign and
-- mail.campaign_event only for their own short statements, and the inbox update (a scan of
-- mail.webhook_event, which has no index on the provider id) holds no lock that blocks the receiver's
-- inserts. Every statement is idempotent, so an interrupted run starts again from the top.

create table if not exists mail.test_email (
    id                  bigint      generated always as identity primary key,
    campaign_id         bigint      not null references mail.campaign (id),
    campaign_event_id   bigint      unique references mail.campaign_event (id),
    tag                 text        not null unique,
    provider_message_id text        unique,
    email               text,
    email_key           text,
    to_masked           text        not null,
    subject             text,
    status              text        not null check (status in ('sending', 'sent', 'not_sent', 'refused', 'unknown')),
    created_at          timestamptz not null default now(),
    sent_at             timestamptz,
    delivered_at        timestamptz,
    hard_bounced_at     timestamptz,
    soft_bounced_at     timestamptz,
    complained_at       timestamptz,
    failed_at           timestamptz,
    delayed_at          timestamptz,
    suppressed_at       timestamptz,
    first_opened_at     timestamptz,
    first_clicked_at    timestamptz,
    opens               integer     not null default 0,
    clicks              integer     not null default 0,
    outcome             text        check (outcome is null or outcome in ('complained', 'hard_bounced', 'failed',
                                                                          'delivered', 'soft_bounced', 'delayed',
                                                                          'suppressed')),
    outcome_at          timestamptz
);
-- "The test emails of a campaign" (the plan and the status show them).
create index if not exists test_email_campaign_idx on mail.test_email (campaign_id, created_at);

comment on table mail.test_email is
    'One test email of a scheduled campaign (never a send-log row: no count, no contact policy), written before '
    'its request; the provider''s outcomes of it are matched here by its provider email id or its tag and folded '
    'into the outcome columns (as mail.delivery_status does for send-log rows).';
comment on column mail.test_email.id is 'Test email id (identity): the test_email_id of its campaign event.';
comment on column mail.test_email.campaign_id is 'The campaign (mail.campaign.id).';
comment on column mail.test_email.campaign_event_id is
    'The campaign event test_email recorded when the provider accepted it; null until then (or never: not sent).';
comment on column mail.test_email.tag is
    'Our id of the test email, sent as the tag mailflow_test: a webhook is matched by it before the provider''s '
    'id is stored. A backfilled row has the uuid of its idempotency key, or campaign-event-<id>.';
comment on column mail.test_email.provider_message_id is 'The provider''s email id (null until accepted).';
comment on column mail.test_email.email is
    'The address it was sent to; null for a row backfilled from a campaign event (only to_masked known).';
comment on column mail.test_email.email_key is 'mailflow.store.policy.mailbox_key(email); null with email.';
comment on column mail.test_email.to_masked is 'The address as events show it: a***@example.com.';
comment on column mail.test_email.subject is 'The subject sent ([TEST] ...).';
comment on column mail.test_email.status is
    'sending (request made, no answer yet, or the task died), sent (accepted), not_sent (proven not processed), '
    'refused (the provider refused it), unknown (no answer: it may have been delivered).';
comment on column mail.test_email.created_at is 'When the row was written, before the request.';
comment on column mail.test_email.sent_at is 'When the provider''s acceptance was recorded (null: not accepted).';
comment on column mail.test_email.delivered_at is 'Earliest delivered (or implied by an open or click) time reported.';
comment on column mail.test_email.hard_bounced_at is 'Earliest permanent bounce reported: the address is suppressed.';
comment on column mail.test_email.soft_bounced_at is 'Earliest transient or undetermined bounce reported (not suppressed).';
comment on column mail.test_email.complained_at is 'Earliest spam complaint reported: the address is suppressed.';
comment on column mail.test_email.failed_at is 'Earliest failed reported (the provider did not send it; alerted).';
comment on column mail.test_email.delayed_at is 'Earliest delivery_delayed reported.';
comment on column mail.test_email.suppressed_at is
    'Earliest report that the address is on the provider''s own suppression list (the address is suppressed).';
comment on column mail.test_email.first_opened_at is 'Earliest open reported.';
comment on column mail.test_email.first_clicked_at is 'Earliest click reported.';
comment on column mail.test_email.outcome is
    'The outcome by precedence, never by arrival order: complained > hard_bounced > suppressed > failed > '
    'delivered > soft_bounced > delayed (mail.delivery_outcome); null: nothing reported yet.';
comment on column mail.test_email.outcome_at is 'When the outcome column last changed (database clock).';
comment on column mail.test_email.opens is 'Open events recorded (each webhook once).';
comment on column mail.test_email.clicks is 'Click events recorded (each webhook once).';

create table if not exists mail.test_email_event (
    id                  bigint      generated always as identity primary key,
    test_email_id       bigint      not null references mail.test_email (id),
    provider_message_id text        not null,
    event               text        not null check (event in ('sent', 'delivered', 'delivery_delayed', 'bounced',
                                                              'complained', 'opened', 'clicked', 'failed',
                                                              'suppressed')),
    bounce_type         text        check (bounce_type is null or event = 'bounced'),
    occurred_at         timestamptz not null,
    recorded_at         timestamptz not null default now(),
    svix_id             text        not null unique
);
create index if not exists test_email_event_test_email_idx on mail.test_email_event (test_email_id, occurred_at);

comment on table mail.test_email_event is
    'Every outcome the provider pushed for a test email (one per svix-id: a replay adds nothing). Appended only.';
comment on column mail.test_email_event.id is 'Surrogate key, in order of recording.';
comment on column mail.test_email_event.test_email_id is 'The test email (mail.test_email.id).';
comment on column mail.test_email_event.provider_message_id is 'The provider''s email id the event is about.';
comment on column mail.test_email_event.recorded_at is 'When it was recorded here (database clock).';
comment on column mail.test_email_event.event is
    'sent, delivered, delivery_delayed, bounced, complained, opened, clicked, failed or suppressed.';
comment on column mail.test_email_event.bounce_type is 'For bounced: Permanent (suppressed), Transient or Undetermined.';
comment on column mail.test_email_event.occurred_at is 'When the provider saw it (the event''s created_at).';
comment on column mail.test_email_event.svix_id is 'The webhook''s svix-id (mail.webhook_event).';

comment on column mail.webhook_event.decision is
    'What applying decided: applied, duplicate_outcome (the outcome was recorded before: nothing changed), '
    'test_email (recorded on a test email, mail.test_email_event), unknown_email (no send-log row or test email '
    'has the id, given up), recipient_mismatch (the provider''s recipient is not the email''s address: not '
    'applied to it; the provider''s recipient is suppressed for a hard bounce or complaint), failed (the provider '
    'did not send it: recorded and alerted), ignored (an event type the send log does not track). Null while '
    'waiting.';

-- Test emails recorded before this file: their campaign events (a few per campaign).
insert into mail.test_email (campaign_id, campaign_event_id, tag, provider_message_id, to_masked, subject, status,
                             created_at, sent_at)
select e.campaign_id, e.id,
       coalesce(substring(e.detail->>'idempotency_key' from '/([0-9a-f]{32})$'), 'campaign-event-' || e.id),
       e.detail->>'provider_id', coalesce(e.detail->>'to', '?'), e.detail->>'subject', 'sent', e.at, e.at
from mail.campaign_event e
where e.detail->>'reason' = 'test_email' and coalesce(e.detail->>'provider_id', '') <> ''
order by e.id
on conflict do nothing;

-- Their webhooks that were given up as unknown: pending again, so the sweep records them on the test email.
update mail.webhook_event w
set applied_at = null, decision = null
from mail.test_email t
where w.decision = 'unknown_email' and w.provider_message_id = t.provider_message_id;
