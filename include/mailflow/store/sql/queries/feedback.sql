-- name: due_checks
-- The safety-net poll's work: sent emails of the lookback window, at least min_age old, that have NO outcome
-- yet (mail.delivery_status.outcome is null: no webhook and no earlier poll reported one) and are due: never
-- polled, or polled fewer than max_checks times with a non-final answer, last polled more than
-- recheck * 2^(checks - 1) ago (exponential spacing). Never-polled first, then the longest-waiting. The window
-- is read through mail.sent_email (0011): one range of send_log_campaign_sent_idx per campaign (the send log
-- has no sent_at index of its own). (Its rows always have a provider id: constraint send_log_sent_has_provider_id.)
select l.send_log_id as id, l.email, l.provider_message_id, coalesce(ds.checks, 0) as checks, l.campaign, l.user_id
from mail.sent_email l
left join mail.delivery_status ds on ds.send_log_id = l.send_log_id
where l.provider_message_id is not null
  and l.sent_at >= now() - make_interval(secs => %(lookback_seconds)s)
  and l.sent_at <= now() - make_interval(secs => %(min_age_seconds)s)
  and (ds.send_log_id is null
       or (ds.outcome is null
           and not ds.final
           and ds.checks < %(max_checks)s
           and (ds.checked_at is null
                or ds.checked_at <= now() - make_interval(secs => %(recheck_seconds)s * power(2, ds.checks - 1)))))
order by ds.checked_at nulls first, l.sent_at, l.send_log_id
limit %(limit)s

-- name: record_check
-- What the provider said about one email, upserted on its send-log id (one row per email); checks
-- counts the polls, final stops them. The outcome columns are the outcomes module's (queries/outcomes.sql).
insert into mail.delivery_status as ds (send_log_id, provider_message_id, last_event, final, checks,
                                        first_checked_at, checked_at)
values (%(id)s, %(pid)s, %(event)s, %(final)s, 1, now(), now())
on conflict (send_log_id) do update
    set last_event = excluded.last_event, final = excluded.final, provider_message_id = excluded.provider_message_id,
        checks = ds.checks + 1, first_checked_at = coalesce(ds.first_checked_at, now()), checked_at = now()
