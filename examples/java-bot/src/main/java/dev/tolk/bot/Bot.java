package dev.tolk.bot;

import io.apicurio.registry.serde.Legacy4ByteIdHandler;
import io.apicurio.registry.serde.SerdeConfig;
import io.apicurio.registry.serde.avro.AvroKafkaDeserializer;
import io.apicurio.registry.serde.avro.AvroKafkaSerializer;
import java.io.InputStream;
import java.time.Duration;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.UUID;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.errors.RecordDeserializationException;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * A bot tolk did not write the serializer of: one text translated through tolk over Kafka.
 *
 * <p>{@code java -cp "target/classes:target/lib/*" dev.tolk.bot.Bot "Where is my order?" de en}
 *
 * <p>The request is a GenericRecord of the bot's copy of {@code translation_request.avsc},
 * serialized by Apicurio's {@code AvroKafkaSerializer} with the schema the registry holds under
 * {@code tolk.requests.<to>-value} (registered by {@code tolk topics create}; the bot never
 * registers) in the Confluent wire format; the reply is read from the bot's reply topic by
 * {@code AvroKafkaDeserializer} and the one whose request_id matches printed as JSON.
 *
 * <p>Environment: TOLK_BOOTSTRAP (127.0.0.1:9092), TOLK_APICURIO_URL
 * (http://127.0.0.1:8085/apis/registry/v2), TOLK_TOPIC_PREFIX (""), BOT_REPLY_TOPIC
 * (prefix + tolk.replies), BOT_TIMEOUT_MS (60000). Exit: 0 OK, 1 another status, 2 no reply.
 */
public final class Bot {
  private Bot() {}

  private static String env(String name, String fallback) {
    String value = System.getenv(name);
    return value == null || value.isEmpty() ? fallback : value;
  }

  public static void main(String[] args) throws Exception {
    String text = args.length > 0 ? args[0] : "Where is my order?";
    String to = args.length > 1 ? args[1] : "de";
    String from = args.length > 2 ? args[2] : "en";
    String prefix = env("TOLK_TOPIC_PREFIX", "");
    String requestTopic = prefix + "tolk.requests." + to;
    String replyTopic = env("BOT_REPLY_TOPIC", prefix + "tolk.replies");
    long timeoutMs = Long.parseLong(env("BOT_TIMEOUT_MS", "60000"));
    String requestId = UUID.randomUUID().toString();

    Map<String, Object> serde = new HashMap<>();
    serde.put(SerdeConfig.REGISTRY_URL, env("TOLK_APICURIO_URL", "http://127.0.0.1:8085/apis/registry/v2"));
    serde.put(SerdeConfig.AUTO_REGISTER_ARTIFACT, false); // `tolk topics create` registered it
    serde.put(SerdeConfig.FIND_LATEST_ARTIFACT, true);
    serde.put(SerdeConfig.ENABLE_HEADERS, false); // the id in the value, not in a header
    serde.put(SerdeConfig.ID_HANDLER, Legacy4ByteIdHandler.class.getName()); // 00 + 4-byte id
    serde.put(SerdeConfig.USE_ID, "contentId"); // the ids the Confluent-compatible API gives

    Properties consumerProps = new Properties();
    consumerProps.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, env("TOLK_BOOTSTRAP", "127.0.0.1:9092"));
    consumerProps.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());
    consumerProps.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, AvroKafkaDeserializer.class.getName());
    consumerProps.putAll(serde);
    Properties producerProps = new Properties();
    producerProps.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, consumerProps.get(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG));
    producerProps.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
    producerProps.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, AvroKafkaSerializer.class.getName());
    producerProps.put(ProducerConfig.ACKS_CONFIG, "all");
    producerProps.putAll(serde);

    Schema schema;
    try (InputStream in = Bot.class.getResourceAsStream("/translation_request.avsc")) {
      schema = new Schema.Parser().parse(in);
    }
    long now = System.currentTimeMillis();
    GenericRecord request = new GenericData.Record(schema);
    request.put("request_id", requestId);
    request.put("conversation_id", null);
    request.put("source_lang", from);
    request.put("target_lang", to);
    request.put("text", text);
    request.put("created_at", now);
    request.put("deadline", now + timeoutMs);
    request.put("reply_topic", replyTopic);
    request.put("model_version", null);
    request.put("metadata", Map.of("bot", "java"));

    try (KafkaConsumer<String, GenericRecord> consumer = new KafkaConsumer<>(consumerProps)) {
      // read the reply topic from its end as it is now: the reply comes after the request
      List<TopicPartition> partitions = consumer.partitionsFor(replyTopic).stream()
          .map(p -> new TopicPartition(replyTopic, p.partition())).toList();
      consumer.assign(partitions);
      consumer.seekToEnd(partitions);
      partitions.forEach(consumer::position);
      try (KafkaProducer<String, GenericRecord> producer = new KafkaProducer<>(producerProps)) {
        producer.send(new ProducerRecord<>(requestTopic, requestId, request)).get();
      }
      long giveUp = System.currentTimeMillis() + timeoutMs;
      while (System.currentTimeMillis() < giveUp) {
        try {
          for (ConsumerRecord<String, GenericRecord> record : consumer.poll(Duration.ofMillis(200))) {
            GenericRecord reply = record.value();
            if (reply != null && requestId.equals(String.valueOf(reply.get("request_id")))) {
              String status = String.valueOf(reply.get("status"));
              System.out.println("{\"request_id\": \"" + requestId + "\", \"status\": \"" + status
                  + "\", \"text\": " + quote(String.valueOf(reply.get("text"))) + "}");
              System.exit("OK".equals(status) ? 0 : 1);
            }
          }
        } catch (RecordDeserializationException e) { // another client's reply, another encoding
          consumer.seek(e.topicPartition(), e.offset() + 1);
        }
      }
    }
    System.err.println("no reply to " + requestId + " on " + replyTopic + " within " + timeoutMs + " ms");
    System.exit(2);
  }

  private static String quote(String s) {
    StringBuilder out = new StringBuilder("\"");
    for (char c : s.toCharArray()) {
      if (c == '"' || c == '\\') {
        out.append('\\').append(c);
      } else if (c < 0x20) {
        out.append(String.format("\\u%04x", (int) c));
      } else {
        out.append(c);
      }
    }
    return out.append('"').toString();
  }
}
