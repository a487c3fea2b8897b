-- Recipients of the demo's scheduled campaign (`make airflow`, demo_outreach): the users on the free
-- plan whom no other campaign had mailed within the contact policy's cooldown (7 days,
-- lifecycle.toml [policy]) when this campaign was created, nor had planned to mail. Those are held
-- back by the policy when their email falls due (deferred by a week), so a campaign of every
-- free-plan user right after `make demo` mostly waits; this one sends as planned.
--
-- It reads the send log (schema mail) next to the app's users: both are in the database the
-- recipients query runs on (provisioning and the dispatcher's address look-up run it on the send-log
-- connection). Only emails that existed when the campaign was created count (minted before its
-- created_at), so the dispatcher's look-up at send time, which runs this query again for the due
-- users, still returns a user whom a later email holds back: the contact policy decides about that
-- one (deferred), the user is not dropped as gone.
--
-- Bound parameters: campaign (its name) and campaign_id, as psycopg named placeholders; they must
-- not appear in comments, and a literal percent sign must be doubled.
select u.user_id,
       u.email,
       u.first_name,
       u.signed_up_at
from app.users u
where u.plan = 'free'
  and not exists (
        select 1
        from mail.send_log l
        join mail.campaign c on c.id = %(campaign_id)s
        where l.user_id = u.user_id
          and l.campaign <> c.name
          and l.minted_at < c.created_at
          and l.status in ('pending', 'sending', 'sent')
          and coalesce(l.sent_at, l.scheduled_at, l.claimed_at, l.minted_at) >= c.created_at - interval '7 days'
      )
